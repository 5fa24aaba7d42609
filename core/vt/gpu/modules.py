"""GpuModules: where a GpuBackend's kernels come from. The kernel source's parts
(``kernels/*.cu``), the modules they compile into (the weights' kernels of every layout, a
layout's own, the other kernels', the short-context attention's), the options each compiles
with, helper threads that build them while a model uploads, and which module a launch
takes its kernel from."""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..protocol.backend import Stream
from . import weights as W
from .runtime import GpuRuntime
from .tuning import _FA_THREADS, GpuTuning

if TYPE_CHECKING:
    from .backend import GpuWeight

#: The block sizes attention's kernels compile for (GpuBackend.attention_threads): whole
#: warps, at most 128 registers a thread at 512.
ATTENTION_THREADS = (128, 256, 512)

#: The kernel source's parts (``kernels/`` beside this module), in the order they join:
#: ``common.cu`` first (macros and helpers every other part uses). All of them are one
#: valid unit (the CPU emulation, ``sass_count.py``); a kernel module compiles a group.
KERNEL_PARTS: tuple[str, ...] = (
    "common.cu",
    "embedding_norm.cu",
    "matmul.cu",
    "matmul_small.cu",
    "matmul_gemv.cu",
    "matmul_int8.cu",
    "blas_copies.cu",
    "rope_kv.cu",
    "attention.cu",
    "attention_tiled.cu",
    "elementwise.cu",
    "sample.cu",
    "logprobs.cu",
)

#: The kernel modules' groups of parts, built side by side on helper threads (a unit of
#: every kernel took 26 s to compile on an H100's machine, the two halves of the thirtieth
#: session 21 s and 11 s; NVRTC 12.9 here: the weights' kernels 15.4 s as one unit, 4.8,
#: 4.7 and 5.0 s as the three groups below; benchmarks/results-compile_groups.json). A
#: kernel comes from the first group whose parts declare it.
MODULE_GROUPS: dict[str, tuple[str, ...]] = {
    # embedding, norms, dequantized copies, 2-7 rows, tiled matmuls without a BLAS
    "rows": ("common.cu", "embedding_norm.cu", "matmul.cu", "matmul_small.cu", "blas_copies.cu"),
    # one row: the gemv kernels, the qkv gemv with RoPE and the KV store, RoPE alone
    "gemv": ("common.cu", "matmul.cu", "matmul_gemv.cu", "rope_kv.cu"),
    # int8 activations: quantize_rows, the dp4a and mma kernels
    "int8": ("common.cu", "matmul.cu", "matmul_int8.cu"),
    # decode attention, sampling, logprobs, the elementwise ops
    "attention": ("common.cu", "attention.cu", "elementwise.cu", "sample.cu", "logprobs.cu"),
    # prefill attention
    "attention_tiled": ("common.cu", "attention_tiled.cu"),
}
#: The groups whose kernels read quantized weights: each compiles once for every layout
#: (read at run time) and once per WT_Q layout a model has (GpuBackend.layout_kernels).
WEIGHT_GROUPS: tuple[str, ...] = ("rows", "gemv", "int8")
#: Attention's decode kernels alone: what the short-context attention's module
#: (GpuBackend.short_context_threads) compiles.
ATTENTION_PARTS: tuple[str, ...] = ("common.cu", "attention.cu")
#: A kernel module: (group, layout), the layout None for the module of every layout (and
#: for the groups outside WEIGHT_GROUPS).
ModuleKey = tuple[str, "int | None"]


@lru_cache(maxsize=16)  # KERNEL_PARTS, MODULE_GROUPS' parts, ATTENTION_PARTS
def kernel_source(parts: tuple[str, ...] = KERNEL_PARTS) -> str:
    """The kernel source of ``parts`` of ``kernels/`` joined, compiled as one unit; all of
    them (the default) are one valid unit too."""
    folder = resources.files(__package__).joinpath("kernels")
    return "".join(folder.joinpath(part).read_text(encoding="utf-8") for part in parts)


#: A kernel's name in an ``extern "C" __global__`` declaration (after launch-bound macros
#: and ``__cluster_dims__(...)``), with what a macro pastes onto it (``attention_tiled_##S``).
_KERNEL_NAME = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:[A-Z_][A-Z0-9_]*\s+|__\w+__\([^)]*\)\s+)*'
    r"(\w+)((?:\s*##\s*\w+)*)\s*\("
)


@lru_cache(maxsize=16)  # KERNEL_PARTS, MODULE_GROUPS' parts
def kernel_names(parts: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The kernels ``parts`` declare: (whole names, prefixes of names a macro completes)."""
    found = _KERNEL_NAME.findall(kernel_source(parts))
    return (
        frozenset(name for name, pasted in found if not pasted),
        tuple(sorted({name for name, pasted in found if pasted})),
    )


@lru_cache(maxsize=512)
def group_of(name: str) -> str:
    """The group of the module kernel ``name`` comes from (MODULE_GROUPS' first group whose
    parts declare it); ValueError naming it where none does."""
    for group, parts in MODULE_GROUPS.items():
        names, prefixes = kernel_names(parts)
        if name in names or name.startswith(prefixes):
            return group
    raise ValueError(f"no kernel module declares a kernel {name!r} (vt.gpu.modules)")


class GpuModules(GpuTuning):
    """A GpuBackend's kernel modules (a base class of it, before GpuResources: its
    ``_begin_capture`` loads what helper threads built before a capture begins)."""

    _rt: GpuRuntime

    def _init_modules(self) -> None:
        # Loaded modules, by ModuleKey
        self._modules: dict[ModuleKey, Any] = {}
        # (the launch's layout, or "short" for the short-context attention's; kernel name)
        # -> function
        self._functions: dict[tuple[int | str | None, str], Any] = {}
        self._short_module: Any = None
        # Modules building on helper threads (by module key), loaded where first launched
        # or before a capture (_prebuild)
        self._builds: dict[ModuleKey, tuple[Future[None], tuple[str, str, list[str]]]] = {}
        self._builder: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _close_modules(self) -> None:
        """Wait for the helper threads and forget every module and function."""
        self._stop_builds()
        self._functions.clear()
        self._modules.clear()
        self._short_module = None

    def compile_options(self, layout: int | None = None) -> list[str]:
        """nvrtc/hiprtc options of the modules of every layout, or (``layout``) of that
        layout's modules (less their ``-DVT_Q_FLAGS``); ValueError naming a bad setting."""
        late = ["-DVT_NORM_LATE=1"] if self.norm_late or self.norm_fold_max_k else []
        if self.attention_threads not in ATTENTION_THREADS:
            raise ValueError(
                f"GpuBackend.attention_threads is {self.attention_threads!r}; attention's "
                f"kernels compile for {', '.join(map(str, ATTENTION_THREADS))} threads"
            )
        fa = [] if self.attention_threads == _FA_THREADS else [
            f"-DFA_THREADS={self.attention_threads}"
        ]  # fmt: skip
        if self.gemv_x16_min_rows < 0:
            raise ValueError(
                f"GpuBackend.gemv_x16_min_rows is {self.gemv_x16_min_rows!r}; 0 (never) or "
                "the fewest weight rows a one-row gemv block takes x as 16-bit codes for"
            )
        flags = self.gemv_x16_layout_flags
        if flags < 0 or flags & ~W.Q_FLAGS:
            raise ValueError(
                f"GpuBackend.gemv_x16_layout_flags is {flags!r}; 0 (every layout) or Q_* "
                "layout flags (vt.gpu.weights: 0x100 the 4-bit layouts)"
            )
        if not isinstance(self.prefetch_bytes, int) or self.prefetch_bytes < 0:
            raise ValueError(
                f"GpuBackend.prefetch_bytes is {self.prefetch_bytes!r}; 0 (no prefetch hint) "
                "or the bytes of the hinted weights attention brings into L2"
            )
        if not isinstance(self.mma_sw1_wave_blocks, int) or self.mma_sw1_wave_blocks < 0:
            raise ValueError(
                f"GpuBackend.mma_sw1_wave_blocks is {self.mma_sw1_wave_blocks!r}; 0 (never) or "
                "the fewest blocks of an 8-row swiglu launch that take swiglu_mma1w_q8a"
            )
        if self.mma_stage not in (False, True):  # 0 and 1 too
            raise ValueError(
                f"GpuBackend.mma_stage is {self.mma_stage!r}; True (the int8 mma kernels' "
                "weight codes through shared memory, their scales in fewer loads) or False"
            )
        return [f"-DVT_WARP={self._rt.warp_size()}", *late, *fa, *self._x16_options(layout)]

    def group_options(self, group: str) -> list[str]:
        """What a group's modules add to compile_options: the int8 group's
        ``-DVT_MMA_STAGE`` (GpuBackend.mma_stage), so no other module's binary changes."""
        return ["-DVT_MMA_STAGE=1"] if group == "int8" and self.mma_stage else []

    def _x16_rows(self, layout: int | None) -> int:
        """The fewest weight rows of a one-row gemv block that take x as 16-bit codes in
        the module of ``layout`` (None: the weights' module of every layout); 0: none do."""
        rows, flags = self.gemv_x16_min_rows, self.gemv_x16_layout_flags
        if flags and (layout is None or layout & flags != flags):
            return 0
        return rows

    def _x16_options(self, layout: int | None) -> list[str]:
        rows = self._x16_rows(layout)
        return [f"-DVT_GV_X16={rows}"] if rows else []

    def gemv_x16_rows(self, *weights: GpuWeight) -> int:
        """The fewest weight rows of a one-row gemv block reading ``weights`` that take x
        as 16-bit codes (0: none do), by the module such a launch comes from."""
        return self._x16_rows(self._layout(weights))

    def _module_source(self, key: ModuleKey) -> tuple[str, str, list[str]]:
        """(source, name, options) of the module ``key`` names (GpuBackend._module)."""
        group, layout = key
        parts = MODULE_GROUPS.get(group)
        if parts is None or (layout is not None and group not in WEIGHT_GROUPS):
            raise ValueError(f"no kernel module {key!r}")
        if layout is None:
            options = [*self.compile_options(), *self.group_options(group)]
            return kernel_source(parts), f"vt_{group}.cu", options
        options = [*self.compile_options(layout), *self.group_options(group),
                   f"-DVT_Q_FLAGS={layout:#x}"]  # fmt: skip
        return kernel_source(parts), f"vt_{group}_q{layout:x}.cu", options

    def _module(self, key: ModuleKey) -> Any:
        """The module ``key`` names: a group's kernels for every WT_Q layout (read at run
        time, the layout None) or compiled for one layout alone. One a helper thread is
        building is waited for (its compile error raised here), then loaded."""
        with self._lock:
            module = self._modules.get(key)
            if module is None:
                build = self._builds.pop(key, None)
                if build is None:
                    module = self._rt.compile(*self._module_source(key))
                else:  # the options it was started with, as a compile at upload had
                    build[0].result()
                    module = self._rt.compile(*build[1])
                self._modules[key] = module
            return module

    def _prebuild(self, key: ModuleKey, lazy: bool = False) -> None:
        """Have ``key``'s module built on a helper thread, once, while the weights go on
        uploading: a machine's first run compiled them one after another (57 s for the
        135M shape on an H100's machine, run 136), and nvrtc and hiprtc release the GIL.
        Only the binary is built there; the module is loaded on the launching thread, at
        its first launch or before a graph capture. Without ``parallel_compile`` or a
        runtime ``prebuild``, compiled here and now (``lazy``: left to its first launch)."""
        if not self.parallel_compile or type(self._rt).prebuild is GpuRuntime.prebuild:
            if not lazy:
                self._module(key)
            return
        with self._lock:
            if key in self._modules or key in self._builds:
                return
            args = self._module_source(key)  # a bad setting raises here, not on a helper
            if self._builder is None:
                workers = max(1, min(16, os.cpu_count() or 1))
                self._builder = ThreadPoolExecutor(workers, thread_name_prefix="vt-kernels")
            self._builds[key] = (self._builder.submit(self._rt.prebuild, *args), args)

    def _prebuild_every_layout(self, lazy: bool = False) -> None:
        """Start every group's module of every layout (``_prebuild``)."""
        for group in MODULE_GROUPS:
            self._prebuild((group, None), lazy)

    def _prebuild_layout(self, layout: int) -> None:
        """Start the weights' groups' modules of ``layout`` (``_prebuild``)."""
        for group in WEIGHT_GROUPS:
            self._prebuild((group, layout))

    def _load_builds(self) -> None:
        """Load every module a helper thread is building (waiting for it): before a graph
        capture, so that no module loads inside one."""
        for key in list(self._builds):
            self._module(key)

    def _stop_builds(self) -> None:
        """Wait for the helper threads' builds (their errors dropped: nothing will load
        them) and let the threads go."""
        with self._lock:
            builds, self._builds = list(self._builds.values()), {}
            builder, self._builder = self._builder, None
        for build, _ in builds:
            build.exception()
        if builder is not None:
            builder.shutdown(wait=True)

    def _begin_capture(self, stream: Stream) -> None:
        self._load_builds()
        super()._begin_capture(stream)

    def _short(self) -> Any:
        """The module of the short-context attention (``attention_split`` for blocks of
        ``short_context_threads``): the attention group's module where attention_threads
        is the same, else ``ATTENTION_PARTS`` compiled with that ``-DFA_THREADS``."""
        threads = self._short_threads()
        if threads == self.attention_threads:
            return self._module(("attention", None))
        with self._lock:
            if self._short_module is None:
                options = [o for o in self.compile_options() if not o.startswith("-DFA_THREADS")]
                if threads != _FA_THREADS:
                    options.append(f"-DFA_THREADS={threads}")
                self._short_module = self._rt.compile(
                    kernel_source(ATTENTION_PARTS), f"vt_attention_t{threads}.cu", options
                )
            return self._short_module

    def _short_threads(self) -> int:
        threads = self.short_context_threads
        if threads not in ATTENTION_THREADS:
            raise ValueError(
                f"GpuBackend.short_context_threads is {threads!r}; attention's kernels "
                f"compile for {', '.join(map(str, ATTENTION_THREADS))} threads"
            )
        return threads

    def _fn(self, name: str, layout: int | None = None, short: bool = False) -> Any:
        """Kernel ``name`` from its module: the short-context attention's, else its group's
        (``group_of``) for ``layout`` (None, or a group outside WEIGHT_GROUPS: the module
        of every layout); found once a (layout, name)."""
        asked = "short" if short else layout
        fn = self._functions.get((asked, name))
        if fn is None:
            if short:
                module = self._short()
            else:
                group = group_of(name)
                if layout is None:
                    # the first kernel a backend launches before any upload (a verification
                    # probe) starts the other groups' modules too, as an upload does
                    self._prebuild_every_layout(lazy=True)
                module = self._module((group, layout if group in WEIGHT_GROUPS else None))
            fn = self._functions[asked, name] = self._rt.get_function(module, name)
        return fn

    def prepare(self) -> None:
        """Compile and load the kernels now, the modules helper threads are building among
        them (upload_weight starts them, so a model's first step only waits for the rest)."""
        for group in MODULE_GROUPS:
            self._module((group, None))
        self._load_builds()
        if self.context_classes:
            self._short()

    def _layout(self, weights: tuple[GpuWeight, ...]) -> int | None:
        """The WT_Q layout all of ``weights`` share, whose module a launch reading them
        takes; None (the modules of every layout) for any other launch."""
        if not self.layout_kernels or not weights or any(w.kind != W.WT_Q for w in weights):
            return None
        layouts = {w.layout for w in weights}
        return layouts.pop() if len(layouts) == 1 else None
