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
#: ``common.cu`` first (macros and helpers every other part uses).
KERNEL_PARTS: tuple[str, ...] = (
    "common.cu",
    "embedding_norm.cu",
    "matmul.cu",
    "blas_copies.cu",
    "rope_kv.cu",
    "attention.cu",
    "attention_tiled.cu",
    "elementwise.cu",
    "sample.cu",
    "logprobs.cu",
)


#: The parts with every kernel that reads a quantized weight: what a layout's own module
#: (GpuBackend.layout_kernels) compiles, and the weights' module of every layout.
LAYOUT_PARTS: tuple[str, ...] = KERNEL_PARTS[:5]
#: The other kernels' parts (attention, sampling, the elementwise ops): a module of their
#: own, built beside the weights' (the two compile in about 16 s and 8 s, one unit in 26).
OTHER_PARTS: tuple[str, ...] = (KERNEL_PARTS[0], *KERNEL_PARTS[5:])
#: Attention's decode kernels alone: what the short-context attention's module
#: (GpuBackend.short_context_threads) compiles.
ATTENTION_PARTS: tuple[str, ...] = ("common.cu", "attention.cu")
#: The module key of the other kernels (GpuBackend._module: None is the weights' module
#: of every layout, an int a layout's own).
OTHER = "other"


@lru_cache(maxsize=4)  # KERNEL_PARTS, LAYOUT_PARTS, OTHER_PARTS, ATTENTION_PARTS
def kernel_source(parts: tuple[str, ...] = KERNEL_PARTS) -> str:
    """The kernel source of ``parts`` of ``kernels/`` joined, compiled as one unit; all of
    them (the default) are one valid unit too (the CPU emulation, ``sass_count.py``)."""
    folder = resources.files(__package__).joinpath("kernels")
    return "".join(folder.joinpath(part).read_text(encoding="utf-8") for part in parts)


#: A kernel's name in an ``extern "C" __global__`` declaration (after launch-bound macros
#: and ``__cluster_dims__(...)``), with what a macro pastes onto it (``attention_tiled_##S``).
_KERNEL_NAME = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:[A-Z_][A-Z0-9_]*\s+|__\w+__\([^)]*\)\s+)*'
    r"(\w+)((?:\s*##\s*\w+)*)\s*\("
)


@lru_cache(maxsize=3)  # KERNEL_PARTS, LAYOUT_PARTS, OTHER_PARTS
def kernel_names(parts: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The kernels ``parts`` declare: (whole names, prefixes of names a macro completes)."""
    found = _KERNEL_NAME.findall(kernel_source(parts))
    return (
        frozenset(name for name, pasted in found if not pasted),
        tuple(sorted({name for name, pasted in found if pasted})),
    )


def is_other_kernel(name: str) -> bool:
    """Whether kernel ``name`` lives in the other kernels' module (OTHER_PARTS), not the
    weights'."""
    names, prefixes = kernel_names(OTHER_PARTS)
    return name in names or name.startswith(prefixes)


class GpuModules(GpuTuning):
    """A GpuBackend's kernel modules (a base class of it, before GpuResources: its
    ``_begin_capture`` loads what helper threads built before a capture begins)."""

    _rt: GpuRuntime

    def _init_modules(self) -> None:
        # Loaded modules (key: None for the weights' kernels of every layout, a layout for
        # that layout's own, OTHER for the other kernels)
        self._modules: dict[int | str | None, Any] = {}
        # (module key, or "short" for the short-context attention's; kernel name) -> function
        self._functions: dict[tuple[int | str | None, str], Any] = {}
        self._short_module: Any = None
        # Modules building on helper threads (by module key), loaded where first launched
        # or before a capture (_prebuild)
        self._builds: dict[int | str | None, tuple[Future[None], tuple[str, str, list[str]]]] = {}
        self._builder: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _close_modules(self) -> None:
        """Wait for the helper threads and forget every module and function."""
        self._stop_builds()
        self._functions.clear()
        self._modules.clear()
        self._short_module = None

    def compile_options(self, layout: int | None = None) -> list[str]:
        """nvrtc/hiprtc options of the weights' module of every layout and of the other
        kernels', or (``layout``) of that layout's module (less its ``-DVT_Q_FLAGS``);
        ValueError naming a bad setting."""
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
        return [f"-DVT_WARP={self._rt.warp_size()}", *late, *fa, *self._x16_options(layout)]

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

    def _module_source(self, key: int | str | None) -> tuple[str, str, list[str]]:
        """(source, name, options) of the module ``key`` names (GpuBackend._module)."""
        if key is None:
            return kernel_source(LAYOUT_PARTS), "vt_kernels.cu", self.compile_options()
        if key == OTHER:
            return kernel_source(OTHER_PARTS), "vt_kernels_other.cu", self.compile_options()
        if not isinstance(key, int):
            raise ValueError(f"no kernel module {key!r}")
        options = [*self.compile_options(key), f"-DVT_Q_FLAGS={key:#x}"]
        return kernel_source(LAYOUT_PARTS), f"vt_kernels_q{key:x}.cu", options

    def _module(self, key: int | str | None = None) -> Any:
        """The module ``key`` names: None the weights' kernels for every WT_Q layout (read
        at run time), a layout the same compiled for that layout alone, OTHER the other
        kernels (attention, sampling, the elementwise ops). One a helper thread is building
        is waited for (its compile error raised here), then loaded."""
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

    def _prebuild(self, key: int | str | None, lazy: bool = False) -> None:
        """Have ``key``'s module built on a helper thread, once, while the weights go on
        uploading: a machine's first run compiled them one after another (54 s for the
        135M shape's three modules on an H100's machine, run 134), and nvrtc and hiprtc
        release the GIL. Only the binary is built there; the module is loaded on the
        launching thread, at its first launch or before a graph capture. Without
        ``parallel_compile`` or a runtime ``prebuild``, compiled here and now (``lazy``:
        left to its first launch)."""
        if not self.parallel_compile or type(self._rt).prebuild is GpuRuntime.prebuild:
            if not lazy:
                self._module(key)
            return
        with self._lock:
            if key in self._modules or key in self._builds:
                return
            args = self._module_source(key)  # a bad setting raises here, not on a helper
            if self._builder is None:
                workers = max(1, min(8, os.cpu_count() or 1))
                self._builder = ThreadPoolExecutor(workers, thread_name_prefix="vt-kernels")
            self._builds[key] = (self._builder.submit(self._rt.prebuild, *args), args)

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
        ``short_context_threads``): the other kernels' module where attention_threads is
        the same, else ``ATTENTION_PARTS`` compiled with that ``-DFA_THREADS``."""
        threads = self._short_threads()
        if threads == self.attention_threads:
            return self._module(OTHER)
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
        """Kernel ``name`` from its module: the short-context attention's, ``layout``'s own,
        or (None) the other kernels' or the weights' of every layout, by where it is (found
        once a name: every launch asks)."""
        asked = "short" if short else layout
        fn = self._functions.get((asked, name))
        if fn is None:
            if short:
                module = self._short()
            elif layout is None:
                # the first kernel a backend launches before any upload (a verification
                # probe) starts its sibling module too, as an upload does
                self._prebuild(None, lazy=True)
                self._prebuild(OTHER, lazy=True)
                module = self._module(OTHER if is_other_kernel(name) else None)
            else:
                module = self._module(layout)
            fn = self._functions[asked, name] = self._rt.get_function(module, name)
        return fn

    def prepare(self) -> None:
        """Compile and load the kernels now, the modules helper threads are building among
        them (upload_weight starts them, so a model's first step only waits for the rest)."""
        self._module()
        self._module(OTHER)
        self._load_builds()
        if self.context_classes:
            self._short()

    def _layout(self, weights: tuple[GpuWeight, ...]) -> int | None:
        """The WT_Q layout all of ``weights`` share, whose module a launch reading them
        takes; None (the weights' module of every layout, or the other kernels') for any
        other launch."""
        if not self.layout_kernels or not weights or any(w.kind != W.WT_Q for w in weights):
            return None
        layouts = {w.layout for w in weights}
        return layouts.pop() if len(layouts) == 1 else None
