"""``vt backends`` and ``vt audit``."""

from __future__ import annotations

import json

import click

from ... import envs
from ...errors import VtError
from ...management.registry import Entry, Registry, Status, default_registry
from ...protocol.capabilities import BOOL_FIELDS, Capabilities, Source
from ...protocol.ops import op_plan, plan_text

#: Short column labels for the table (JSON always uses the full field names).
SHORT = {
    "unified_memory": "unified",
    "device_memory_is_host_addressable": "host-addressable",
    "host_memory_is_device_addressable": "device-addressable",
    "supports_async_sampled_token_readback": "async-readback",
    "async_d2h_copy": "async-d2h",
    "events": "events",
    "pinned_host_memory": "pinned",
    "graphs": "graphs",
}


def _mib(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n}B"


def _caps_text(caps: Capabilities | None) -> str:
    if caps is None:
        return "-"
    parts = [SHORT[f] for f in BOOL_FIELDS if getattr(caps, f)]
    if caps.vmm is not None:
        alias = ",may-alias" if caps.vmm.segments_may_alias else ""
        parts.append(f"vmm({_mib(caps.vmm.granularity)}{alias})")
    return " ".join(parts) or "none"


def _provenance_text(caps: Capabilities | None) -> list[str]:
    if caps is None:
        return []
    out = []
    for field, prov in sorted(caps.provenance.items()):
        if prov.source is Source.declared:
            continue
        value = getattr(caps, field)
        shown = "off" if value is None or value is False else "on" if value is True else value
        out.append(f"{field}={shown} ({prov.source.value}: {prov.detail})")
    return out


def _fail(exc: VtError) -> click.ClickException:
    return click.ClickException(str(exc))


def _table(entries: list[Entry], debug: bool = False) -> str:
    rows = [("NAME", "DISTRIBUTION", "STATUS", "PRIO", "CAPABILITIES")]
    for e in entries:
        dist = f"{e.distribution} {e.version}".strip() or "?"
        rows.append((e.name, dist, e.status.value, str(e.priority), _caps_text(e.capabilities)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4]
        )
        if i == 0:
            continue
        e = entries[i - 1]
        pad = " " * 4
        if e.device:
            lines.append(f"{pad}device: {e.device}")
        if e.reason:
            label = "note" if e.status is Status.available else "reason"
            lines.append(f"{pad}{label}: {e.reason}")
        if e.emulated:
            lines.append(f"{pad}emulator: auto never picks it; use --backend {e.name}")
        if e.backend_class is not None:
            lines.append(f"{pad}ops: {plan_text(op_plan(set(e.ops).__contains__))}")
        if debug and e.traceback:
            lines.append(f"{pad}traceback (VT_DEBUG):")
            lines += [f"{pad}  {line}" for line in e.traceback.rstrip("\n").splitlines()]
        for text in _provenance_text(e.capabilities):
            lines.append(f"{pad}{text}")
    return "\n".join(lines)


@click.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def backends(as_json: bool) -> None:
    """List every installed backend plugin, its status and effective capabilities.

    \b
    Status is one of:
      available    the backend can be selected
      unavailable  its hardware or library is not here (the reason says which)
      rejected     its declared capabilities break a rule (see docs/capabilities.md)
      broken       the plugin raised while loading or probing (the error is shown)

    Capabilities are the effective ones: the backend's declaration with VT_CAPS
    overrides applied; overridden values are listed with their source. The last line
    says which backend `auto` would pick and why. `auto` never picks an emulator (such
    as tt_stub) nor a backend name that two plugins register; name it instead.

    \b
    Environment:
      VT_PLUGINS=a,b   load only these plugins (empty: only cpu)
      VT_CAPS=...      override capabilities, e.g. "events=0,cpu:vmm=off"
      VT_BACKEND=NAME  the backend other commands use by default
      VT_DEBUG=1       print each broken plugin's own traceback

    \b
    Examples:
      vt backends
      vt backends --json
      VT_CAPS="cpu:async_readback=0" vt backends   # see an override and its provenance
      VT_DEBUG=1 vt backends                       # why a plugin is broken, in full
    """
    registry = default_registry()
    try:
        debug = envs.get("VT_DEBUG")
        entries = registry.entries()
    except VtError as exc:
        raise _fail(exc) from exc
    try:
        auto, why = registry.select("auto")
    except VtError as exc:
        auto, why = None, str(exc)
    if as_json:
        items = []
        for e in entries:
            item = e.to_json()
            item["auto"] = auto is e
            items.append(item)
        click.echo(json.dumps(items, indent=2))
        return
    if not entries:
        click.echo("no backend plugins installed (entry point group 'vt')")
    else:
        click.echo(_table(entries, debug))
    click.echo("")
    click.echo(why)


@click.command("audit")
@click.option(
    "--backend",
    "-b",
    "backend",
    default=None,
    metavar="NAME",
    help="Audit only this backend (`auto`: the one auto would pick). Default: every "
    "installed backend. A named backend that is not available fails the audit.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--matrix",
    is_flag=True,
    help="Run the conformance kit instead and print the support matrix (kernel x dtype, "
    "capability, model) as Markdown; --backend may then be a comma list.",
)
def audit(backend: str | None, as_json: bool, matrix: bool) -> None:
    """Prove each backend's declared capabilities with rule checks and runtime probes.

    Rule checks re-run every consistency rule on the effective capabilities. Probes
    start the backend and exercise what it declares: host_view round-trips (or refuses
    when memory is not host-addressable), event ordering, pinned memory, async
    device-to-host copies into a poisoned buffer, the sampled-token readback path, and
    the VMM arena. A probe that cannot run is reported as skipped with its reason.

    Exit status is 0 only when every executed check of every audited backend passed
    and at least one ran. Without --backend, unavailable backends are reported (their
    probes skipped) but do not fail the audit; named, they do.

    --matrix runs vt's conformance kit (the tests of `pytest --vt-backend NAME`) on each
    backend and prints the support matrix; exit status 0 only if every case passed.

    \b
    Examples:
      vt audit
      vt audit --backend cpu --json
      vt audit --matrix --backend cpu,tt_stub > support-matrix.md
    """
    if matrix:
        from ...testing.matrix import matrix_command

        raise SystemExit(matrix_command(backend, as_json))
    from ...management.audit import audit as run_audit

    registry: Registry = default_registry()
    try:
        report = run_audit(backend, registry)
    except VtError as exc:
        raise _fail(exc) from exc
    if as_json:
        click.echo(report.model_dump_json(indent=2))
    else:
        marks = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}
        for b in report.backends:
            click.echo(f"{b.name} ({b.status})")
            if b.ops:
                click.echo(f"  ops    {plan_text(b.ops)}")
            for c in b.checks:
                click.echo(f"  {marks[c.result]}  {c.kind:<5}  {c.id}: {c.detail}")
            ran = [c for c in b.checks if c.result != "skip"]
            passed = sum(c.result == "pass" for c in ran)
            click.echo(
                f"  => {'ok' if b.ok else 'FAILED'}: {passed} of {len(ran)} executed checks "
                f"passed, {len(b.checks) - len(ran)} skipped"
            )
        click.echo("audit " + ("passed" if report.ok else "FAILED"))
    raise SystemExit(0 if report.ok else 1)


COMMANDS = [backends, audit]
