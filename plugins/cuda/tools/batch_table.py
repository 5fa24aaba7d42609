"""Print the rows of ``vt bench --batch --json`` files, one line per (file, async, batch).

python plugins/cuda/tools/batch_table.py batch-smol.json batch-smol-nofused.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    for path in sys.argv[1:]:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"{path}: unreadable ({exc})")
            continue
        for r in doc.get("batch_runs", []):
            g = r.get("graph_stats", {})
            print(
                f"{Path(path).stem:<22} async={'on ' if r['async_scheduling'] else 'off'} "
                f"B={r['batch']:<3} decode {r['decode_tok_s'] or 0:9.1f} tok/s  e2e "
                f"{r['e2e_tok_s']:9.1f} tok/s  steps {r['steps']:<4} same_ids={r['same_ids']} "
                f"replays={g.get('replays', 0)} captures={g.get('captures', 0)}"
            )
        stem, same, load = Path(path).stem, doc.get("same_ids"), doc.get("load_s", 0.0)
        print(f"{stem}: same_ids={same} load_s={load:.1f}")


if __name__ == "__main__":
    main()
