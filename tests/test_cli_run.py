"""`vt run` and `vt bench` on tiny GGUFs (cpu, tt_stub), through CliRunner and a subprocess.

Tests marked slow run the default model from the model cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from vt.frontends.cli import main
from vt.model import ChatTemplate, Tokenizer, load_gguf
from vt.testing.tiny import write_tiny_gguf

RUN_KEYS = {
    "backend",
    "model",
    "readback",
    "prompt_ids",
    "ids",
    "text",
    "finish_reason",
    "timings",
    "kv_cache",
}
KV_KEYS = {"backend", "reserved_bytes", "mapped_bytes", "segments"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Untied output weights: the tied tiny model mostly repeats its last token.
    return write_tiny_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", tied=False)


@pytest.fixture(autouse=True)
def _async_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VT_ASYNC_RUNNER", raising=False)
    monkeypatch.delenv("VT_DEBUG", raising=False)


def vt(*args: str, input: str | None = None, env: dict | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input, env=env)


def run_json(tiny: Path, *args: str, env: dict | None = None) -> dict:
    res = vt("run", "--model", str(tiny), "--json", *args, env=env)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_json_has_the_documented_keys(tiny: Path) -> None:
    obj = run_json(tiny, "--backend", "cpu", "--raw", "-n", "8", "Hello world!")
    assert RUN_KEYS <= set(obj)
    assert obj["backend"] == "cpu" and obj["readback"] == "host_view"
    assert obj["model"] == "tiny-llama-Q8_0"
    assert {"prefill_tok_s", "decode_tok_s"} <= set(obj["timings"])
    assert set(obj["kv_cache"]) == KV_KEYS and obj["kv_cache"]["backend"] == "vmm"
    tok = Tokenizer.from_model(load_gguf(tiny))
    assert obj["prompt_ids"] == tok.encode("Hello world!")
    assert 1 <= len(obj["ids"]) <= 8
    assert obj["text"] == tok.decode(
        [i for i in obj["ids"] if i not in tok.stop_ids], skip_special=True
    )
    assert obj["finish_reason"] in ("stop", "length")


def test_same_ids_with_async_off_on_tt_stub_and_contiguous_kv(tiny: Path) -> None:
    args = ("--raw", "-n", "16", "--ignore-eos", "The capital of France is")
    ref = run_json(tiny, "--backend", "cpu", *args)
    assert len(ref["ids"]) == 16 and ref["finish_reason"] == "length"
    off = run_json(tiny, "--backend", "cpu", *args, env={"VT_ASYNC_RUNNER": "0"})
    assert off["readback"] == "sync" and off["ids"] == ref["ids"]
    stub = run_json(tiny, "--backend", "tt_stub", *args)
    assert stub["backend"] == "tt_stub" and stub["readback"] == "sync"
    assert stub["ids"] == ref["ids"]
    contiguous = run_json(tiny, "--backend", "cpu", "--kv-cache", "contiguous", *args)
    assert contiguous["kv_cache"]["backend"] == "contiguous"
    assert contiguous["ids"] == ref["ids"]


def test_backend_from_the_environment(tiny: Path) -> None:
    obj = run_json(tiny, "--raw", "-n", "2", "Hi", env={"VT_BACKEND": "tt_stub"})
    assert obj["backend"] == "tt_stub"


def test_streams_text_and_prints_one_summary_line(tiny: Path) -> None:
    args = ("--model", str(tiny), "--backend", "cpu", "-n", "12", "Hello")
    obj = run_json(tiny, *args[2:])
    res = vt("run", *args)
    assert res.exit_code == 0
    assert res.stdout == obj["text"] + ("" if obj["text"].endswith("\n") else "\n")
    lines = res.stderr.splitlines()
    assert len(lines) == 1
    line = lines[0]
    for part in (
        "backend cpu",
        "'cpu' was asked for by --backend",
        "readback host_view",
        "kv vmm",
        "prefill",
        "decode",
        "tok/s",
        f"finish {obj['finish_reason']}",
    ):
        assert part in line
    assert vt("run", "--no-stream", *args).stdout == res.stdout


def test_auto_backend_says_why(tiny: Path) -> None:
    res = vt("run", "--model", str(tiny), "-n", "2", "Hi")
    assert res.exit_code == 0, res.output
    assert "auto picked" in res.stderr


def test_chat_template_system_and_raw(tiny: Path) -> None:
    template = ChatTemplate.from_model(load_gguf(tiny))
    tok = Tokenizer.from_model(load_gguf(tiny))
    chat = run_json(tiny, "-n", "2", "--system", "Be brief.", "Hello")
    rendered = template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    )
    assert chat["prompt_ids"] == tok.encode(rendered)
    raw = run_json(tiny, "-n", "2", "--raw", "Hello")
    assert raw["prompt_ids"] == tok.encode("Hello")


def test_prompt_from_stdin(tiny: Path) -> None:
    res = vt("run", "--model", str(tiny), "--json", "--raw", "-n", "2", "-", input="Hello\n")
    assert res.exit_code == 0, res.output
    assert (
        json.loads(res.stdout)["prompt_ids"]
        == run_json(tiny, "--raw", "-n", "2", "Hello")["prompt_ids"]
    )


def test_stop_string_and_sampling_options(tiny: Path) -> None:
    args = ("--raw", "-n", "16", "--ignore-eos", "Hello world!")
    full = run_json(tiny, *args)["text"]
    cut = next(i for i in range(3, len(full) - 1) if full[i : i + 2].isprintable())
    stop = full[cut : cut + 2]
    obj = run_json(tiny, "--stop", stop, *args)
    assert obj["text"] == full[: full.find(stop)] and obj["finish_reason"] == "stop"
    sampled = ("--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--seed", "7")
    a, b = run_json(tiny, *sampled, *args), run_json(tiny, *sampled, *args)
    assert a["ids"] == b["ids"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "--temperature: temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p: top_p must be in (0, 1], got 0.0"),
        (["--top-k", "-2"], "--top-k: top_k must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens: max_tokens must be at least 1, got 0"),
        (["--seed", "-1"], "--seed: seed must be between 0 and 4294967295"),
        (["--stop", ""], "--stop: stop strings must not be empty"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--model", "/nonexistent/x.gguf"], "/nonexistent/x.gguf: no such model file"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--max-model-len", "1"], "--max-model-len must be at least 2"),
        (["--max-model-len", "100000"], "must be between 1 and the model's context length 256"),
        (["--max-model-len", "4"], "but max_model_len is 4"),
        (["--raw", "--system", "x"], "--system needs the chat template; drop --raw"),
        (["--model", "/dev/null"], "/dev/null: is not a regular file"),
        # No VMM on tt_stub: an explicit vmm cache is an error, never a silent contiguous one.
        (
            ["--backend", "tt_stub", "--kv-cache", "vmm"],
            "backend 'tt_stub' does not declare vmm; use a contiguous allocation",
        ),
    ],
)
def test_bad_input_is_one_clear_line(tiny: Path, args: list[str], message: str) -> None:
    model = [] if "--model" in args else ["--model", str(tiny)]
    res = vt("run", *model, *args, "Hello, how are you today?")
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("Error: ") and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert res.stdout == ""


def test_a_file_that_is_not_gguf_is_one_clear_line(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model\n")
    res = vt("run", "--model", str(text), "Hi")
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr == (
        f"Error: {text}: not a GGUF file: the magic bytes are b'hell', expected b'GGUF'\n"
    )


@pytest.mark.parametrize("prompt", ["", "   ", "-"])
def test_empty_prompt(tiny: Path, prompt: str) -> None:
    res = vt("run", "--model", str(tiny), prompt, input="\n")
    assert res.exit_code == 1 and "the prompt is empty" in res.stderr


def test_usage_errors_exit_2(tiny: Path) -> None:
    res = vt("run", "--model", str(tiny), "--kv-cache", "paged", "Hi")
    assert res.exit_code == 2 and "'paged' is not one of" in res.stderr
    res = vt("run", "--model", str(tiny), "--max-tokens", "many", "Hi")
    assert res.exit_code == 2 and "'many' is not a valid integer" in res.stderr
    assert vt("run").exit_code == 2


def test_bad_async_env_is_an_error(tiny: Path) -> None:
    res = vt("run", "--model", str(tiny), "Hi", env={"VT_ASYNC_RUNNER": "maybe"})
    assert res.exit_code == 1 and "VT_ASYNC_RUNNER='maybe' is not a boolean" in res.stderr


def test_ctrl_c_stops_cleanly(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vt.frontends.engine import Engine

    real_step = Engine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    res = vt("run", "--model", str(tiny), "--raw", "--ignore-eos", "-n", "50", "Hello")
    assert res.exit_code == 130
    assert res.stderr.strip() == "vt: interrupted"
    assert res.stdout.endswith("\n") and len(res.stdout) > 1


def test_ctrl_c_while_loading(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    bench_module = importlib.import_module("vt.frontends.bench")
    llm_module = importlib.import_module("vt.frontends.llm")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm_module.LLM, "__init__", interrupted)
    res = vt("run", "--model", str(tiny), "Hello")
    assert res.exit_code == 130 and res.stderr == "vt: interrupted\n" and res.stdout == ""
    monkeypatch.setattr(bench_module, "run_bench", interrupted)
    res = vt("bench", "--model", str(tiny))
    assert res.exit_code == 130 and res.stderr == "vt bench: interrupted\n"


def test_help_lists_every_option() -> None:
    out = vt("run", "--help").stdout
    for opt in (
        "--model",
        "--backend",
        "--max-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--system",
        "--raw",
        "--no-stream",
        "--json",
        "--kv-cache",
        "--max-model-len",
        "VT_BACKEND",
        "VT_ASYNC_RUNNER",
    ):
        assert opt in out
    out = vt("bench", "--help").stdout
    for opt in ("--prompt-tokens", "--gen-tokens", "--kv-cache", "--max-model-len", "--json"):
        assert opt in out


def _subprocess(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", "from vt.frontends.cli import main; main()", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def test_real_subprocess(tiny: Path) -> None:
    proc = _subprocess("run", "--model", str(tiny), "--backend", "cpu", "--json", "-n", "4", "Hi")
    assert proc.returncode == 0, proc.stderr
    assert RUN_KEYS <= set(json.loads(proc.stdout))
    proc = _subprocess("run", "--model", str(tiny), "--top-p", "2", "Hi")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "Error: --top-p: top_p must be in (0, 1], got 2.0"


# --------------------------------------------------------------------------- vt bench


def test_bench_json(tiny: Path) -> None:
    res = vt(
        "bench",
        "--model",
        str(tiny),
        "--backend",
        "cpu",
        "--prompt-tokens",
        "20",
        "--gen-tokens",
        "8",
        "--repeat",
        "2",
        "--json",
    )
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["backend"] == "cpu" and obj["same_ids"] is True
    assert [(r["async_scheduling"], r["readback"]) for r in obj["runs"]] == [
        (True, "host_view"),
        (False, "sync"),
    ]
    for r in obj["runs"]:
        assert r["prompt_tokens"] == 20 and r["gen_tokens"] == 8 and r["repeat"] == 2
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert r["cached_prompt_tokens"] == 0  # each repeat prefills all 20 tokens
        assert set(r["kv_cache"]) == KV_KEYS
        assert r["graphs"] is True and "captured once per shape" in r["graphs_reason"]
    # cpu declares graphs: decode steps replay with async scheduling on and off (then the
    # host hands each step its token)
    on, off = (r["graph_stats"] for r in obj["runs"])
    assert on["captures"] >= 1 and on["replays"] >= 1
    assert off["captures"] >= 1 and off["replays"] >= 1
    assert obj["peak_rss_bytes"] >= obj["rss_bytes"] > 0


def test_bench_batches_json_and_table(tiny: Path) -> None:
    args = ["--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "12", "--gen-tokens",
            "6", "--repeat", "1", "--batch", "1,3"]  # fmt: skip
    res = vt("bench", *args, "--json")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["runs"] == [] and obj["same_ids"] is True
    runs = obj["batch_runs"]
    assert [(r["async_scheduling"], r["batch"]) for r in runs] == [
        (True, 1), (True, 3), (False, 1), (False, 3),
    ]  # fmt: skip
    for r in runs:
        assert r["prompt_tokens"] == 12 and r["gen_tokens"] == 6 and r["same_ids"] is True
        assert r["decode_tok_s"] > 0 and r["e2e_tok_s"] > 0 and "ids" not in r
        # every request's first token, then 5 more each
        assert r["decode_tokens"] == 5 * r["batch"] and r["steps"] >= 6
    res = vt("bench", *args)
    assert res.exit_code == 0, res.output
    assert "async  batch  decode tok/s" in res.stdout
    assert "same greedy ids in every request and setting: yes" in res.stdout


def test_bench_batch_says_why_requests_can_part_where_they_did(tiny: Path) -> None:
    """Where a batch's identical requests did not all generate the same ids (a GPU's
    near-tie, decided by the kernels of each step's shape), the report says why under its
    NO, so a user does not take it for a race; where they did, nothing more."""
    from vt.frontends.bench import BenchResult, format_table

    res = vt("bench", "--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "12",
             "--gen-tokens", "6", "--repeat", "1", "--batch", "1,3", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    for r in obj["batch_runs"]:
        r["ids"] = []  # not in --json
    same = format_table(BenchResult.model_validate(obj))
    assert "same greedy ids in every request and setting: yes" in same
    assert "near-tie" not in same
    obj["same_ids"] = obj["batch_runs"][1]["same_ids"] = False
    parted = format_table(BenchResult.model_validate(obj)).splitlines()
    at = parted.index("same greedy ids in every request and setting: NO")
    assert "near-tie between two ids can go either way" in parted[at + 1]
    assert "the same batch and schedule give the same ids every time" in parted[at + 1]


@pytest.mark.parametrize("value", ["0", "x", ",", "1,-2"])
def test_bench_bad_batch(tiny: Path, value: str) -> None:
    res = vt("bench", "--model", str(tiny), "--batch", value)
    assert res.exit_code == 1
    assert "--batch takes batch sizes of at least 1, comma separated" in res.stderr


def test_bench_table_and_kv_choice(tiny: Path) -> None:
    res = vt(
        "bench",
        "--model",
        str(tiny),
        "--backend",
        "tt_stub",
        "--kv-cache",
        "contiguous",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
    )
    assert res.exit_code == 0, res.output
    assert "same greedy ids with async on and off: yes" in res.stdout
    assert "contiguous" in res.stdout and "peak RSS" in res.stdout
    assert "graphs: off (the backend does not declare graphs" in res.stdout


def test_bench_table_says_which_setting_replayed_graphs(tiny: Path) -> None:
    args = ("--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "8", "--gen-tokens", "6")
    res = vt("bench", *args, "--repeat", "1")
    assert res.exit_code == 0, res.output
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("graphs:")]
    assert line.startswith("graphs: on (decode steps are captured once per shape")
    replays = line.split("; steps replayed: ")[1]
    on, off = replays.split(", ")
    assert int(on.split()[0]) >= 1 and on.endswith("with async on")
    assert int(off.split()[0]) >= 1 and off.endswith("with async off")
    lines = res.stdout.splitlines()
    assert lines[lines.index(line) + 1] == (
        "prefill and mixed steps run eagerly (the cpu backend's prefill_graphs hint)"
    )


def test_bench_says_the_context_classes_its_graphs_are_keyed_by(tiny: Path) -> None:
    """None on cpu (in the JSON too); a backend's classes in the graphs line."""
    from vt.frontends.bench import BenchRun, _graphs_line

    args = ("--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "8", "--gen-tokens", "4")
    res = vt("bench", *args, "--repeat", "1", "--json")
    assert res.exit_code == 0, res.output
    assert all(r["context_classes"] == [] for r in json.loads(res.stdout)["runs"])
    run = BenchRun.model_construct(
        async_scheduling=True, graphs=True, graphs_reason="default", graph_stats={"replays": 3},
        prefill_graphs=False, prefill_graphs_reason="eager", context_classes=[512],
    )  # fmt: skip
    assert _graphs_line([run]).split("\n")[0] == (
        "graphs: on (default); steps replayed: 3 with async on; keyed by context class "
        "(positions: 512)"
    )


def test_bench_batches_say_the_context_classes_too(tiny: Path) -> None:
    """`--batch` runs carry the classes in their JSON (none on cpu) and their graphs line:
    a variant's JSON says whether its graphs were keyed by them."""
    from vt.frontends.bench import BenchResult, _format_batches

    args = ("--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "8", "--gen-tokens", "4")
    res = vt("bench", *args, "--batch", "1,2", "--repeat", "1", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [r["context_classes"] for r in data["batch_runs"]] == [[]] * 4
    for r in data["batch_runs"]:
        r["ids"] = []  # the JSON leaves them out
    assert "keyed by context class" not in _format_batches(BenchResult.model_validate(data))
    for r in data["batch_runs"]:
        r["context_classes"] = [256, 512]
    (line,) = [
        x for x in _format_batches(BenchResult.model_validate(data)).splitlines()
        if x.startswith("graphs:")
    ]  # fmt: skip
    assert line.endswith("warm-up included; keyed by context class (positions: 256, 512)")


def test_bench_says_each_repeats_prefill_rate_with_prefill_graphs(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VT_PREFILL_GRAPHS", "1")
    args = ("--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "20", "--gen-tokens", "3")
    res = vt("bench", *args, "--repeat", "3")
    assert res.exit_code == 0, res.output
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("prefill and mixed steps")]
    head = "prefill and mixed steps are padded to a token bucket and replayed (VT_PREFILL_GRAPHS=1)"
    assert line.startswith(head + "; prefill tok/s of each repeat: async on ")
    assert line.count(", ") == 4  # three rates each with async on and off
    data = json.loads(vt("bench", *args, "--repeat", "3", "--json").stdout)
    for run in data["runs"]:
        assert run["prefill_graphs"] and len(run["prefill_tok_s_each"]) == 3
        assert run["prefill_tok_s"] == max(run["prefill_tok_s_each"])
        assert run["graph_stats"]["captures"] >= 2  # the prompt's bucket and the decode's


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-tokens", "0"], "--prompt-tokens must be at least 1, got 0"),
        (["--gen-tokens", "-3"], "--gen-tokens must be at least 1, got -3"),
        (["--repeat", "0"], "--repeat must be at least 1, got 0"),
        (
            ["--max-model-len", "16", "--prompt-tokens", "12", "--gen-tokens", "8"],
            "prompt_tokens + gen_tokens = 20 exceeds max_model_len 16",
        ),
        (["--backend", "nope"], "unknown backend 'nope'"),
    ],
)
def test_bench_bad_input(tiny: Path, args: list[str], message: str) -> None:
    res = vt("bench", "--model", str(tiny), *args)
    assert res.exit_code == 1 and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_bench_prefills_in_chunks_of_max_batch_tokens(tiny: Path) -> None:
    args = ("--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "9", "--gen-tokens", "2")
    res = vt("bench", *args, "--repeat", "1", "--max-batch-tokens", "4", "--json")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["max_batch_tokens"] == 4 and obj["same_ids"]
    assert all(r["prefill_tok_s"] > 0 for r in obj["runs"])
    unset = vt("bench", *args, "--repeat", "1", "--json")  # the backend's default_batch_tokens
    assert unset.exit_code == 0, unset.output
    assert json.loads(unset.stdout)["max_batch_tokens"] == 256
    bad = vt("bench", *args, "--max-batch-tokens", "0")
    assert bad.exit_code == 2 and "--max-batch-tokens" in bad.stderr and "0" in bad.stderr


# --------------------------------------------------------------------------- default model


@pytest.mark.slow
def test_default_model_raw_completion() -> None:
    res = vt("run", "--json", "--raw", "-n", "8", "The capital of France is")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["prompt_ids"] == [504, 3575, 282, 4649, 314]
    assert obj["text"].startswith(" Paris.")


@pytest.mark.slow
def test_default_model_chat_async_on_and_off() -> None:
    args = ("run", "--json", "-n", "24", "Why is the sky blue?")
    on = json.loads(vt(*args).stdout)
    off = json.loads(vt(*args, env={"VT_ASYNC_RUNNER": "0"}).stdout)
    assert on["readback"] != "sync" and off["readback"] == "sync"
    assert on["ids"] == off["ids"] and on["text"].strip()


@pytest.mark.slow
def test_default_model_bench() -> None:
    res = vt("bench", "--json", "--prompt-tokens", "64", "--gen-tokens", "16")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["same_ids"] is True
    assert all(r["decode_tok_s"] > 0 for r in obj["runs"])


_BENCH_MODULES = """
import sys
from vt.frontends.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    heavy = ("jinja2", "starlette", "uvicorn", "rocm.bindings.hip", "hip")
    heavy += ("psutil",) if sys.platform == "linux" else ()
    print(sorted(m for m in heavy if m in sys.modules))
"""


def test_bench_imports_no_template_engine_server_or_hip_bindings(tiny: Path) -> None:
    # Memory (issue 10): what vt bench never uses, it never imports (each costs RSS).
    args = ["bench", "--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "8",
            "--gen-tokens", "2", "--repeat", "1", "--json"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _BENCH_MODULES, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_bench_rss_reads_what_psutil_reads() -> None:
    import psutil
    from vt.frontends.bench import peak_rss_bytes, rss_bytes

    now, theirs = rss_bytes(), psutil.Process().memory_info().rss
    assert abs(now - theirs) < 4 << 20 and peak_rss_bytes() >= now


def test_bench_batch_takes_each_rate_from_its_best_repeat() -> None:
    """A batch's decode and end-to-end rates are each the best of the repeats: a first
    repeat that paid a one-time cost (a prefill graph captured, a library initialised)
    before its decode window does not set the end-to-end figure."""
    from types import SimpleNamespace

    from vt.frontends.bench import _BatchTiming, _record_batch

    ids = [[1, 2, 3]]
    first = _BatchTiming(decode_s=0.10, decode_tokens=100, e2e_s=1.20, tokens=128, steps=128,
                         ids=ids)  # fmt: skip
    second = _BatchTiming(decode_s=0.11, decode_tokens=100, e2e_s=0.16, tokens=128, steps=128,
                          ids=ids)  # fmt: skip
    runner = SimpleNamespace(readback="async_d2h", graphs=True, graphs_reason="",
                             graph_stats={"captures": 2, "replays": 257},
                             context_classes=(512,))  # fmt: skip
    run = _record_batch(True, runner, 1, 128, [first, second], {})
    assert run.decode_tok_s == pytest.approx(1000.0) and run.decode_s == 0.10
    assert run.e2e_tok_s == pytest.approx(800.0) and run.e2e_s == 0.16
    assert run.repeat == 2 and run.same_ids
    assert run.context_classes == [512]  # the runner's, as a list
