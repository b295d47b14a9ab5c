"""The child of an enforced run (or an RPC one): `python -m flexoffload.api PREPARED.json RESULT.json
[--stream-text]`. It runs the parent's Prepared here, in this process, as decided: it does not prepare again (the
parent made the child to hold it in the cgroup)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from flexoffload import FlexoffloadError, native
from flexoffload.api.running import run_prepared
from flexoffload.api.prepared import Prepared


def main() -> None:
    prepared_file, result_file, *flags = sys.argv[1:]
    try:
        p = Prepared.from_json(Path(prepared_file).read_text())
        if p.settings.rpc:
            native.spin_briefly()
        on_text = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if "--stream-text" in flags else None
        if p.request.chat:  # the parent waits with Ctrl-C ignored, which the child inherits: here it stops a reply
            signal.signal(signal.SIGINT, signal.default_int_handler)
        result = run_prepared(p, on_text)
    except FlexoffloadError as e:
        print(f"flexoffload: {e}", file=sys.stderr)
        sys.exit(1)
    import json

    Path(result_file).write_text(json.dumps(result))
