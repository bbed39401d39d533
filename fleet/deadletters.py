"""Dead letters: list them, and put their jobs back in the queue once the cause is fixed.

    python -m fleet.deadletters list [--model M]
    python -m fleet.deadletters requeue ID [ID ...] [--model M]
    python -m fleet.deadletters requeue --all [--model M]

A dead letter is a stream entry delivered more than MAX_DELIVERIES times: each delivery
ended with its worker dying (a poison input, or a model that crashes the process).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from shared.dead_letters import DeadLetters
from shared.settings import get_settings


def main(argv: list[str] | None = None, prog: str = "python -m fleet.deadletters") -> int:
    settings = get_settings()
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=settings.served_model)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print dead letters as JSON lines")
    requeue = sub.add_parser("requeue", help="queue the jobs of these dead letters again")
    requeue.add_argument("ids", nargs="*")
    requeue.add_argument("--all", action="store_true")
    args = parser.parse_args(argv)

    dead = DeadLetters.from_settings(settings)
    letters = dead.list(args.model)
    if args.command == "list":
        for letter in letters:
            at = datetime.fromtimestamp(float(letter["at"]), UTC).isoformat()
            print(json.dumps(letter | {"at": at}))
        return 0
    ids = [letter["id"] for letter in letters] if args.all else args.ids
    if not ids:
        parser.error("name dead-letter ids, or --all")
    status = 0
    for letter_id in ids:
        try:
            entry = dead.requeue(args.model, letter_id)
        except KeyError:
            print(f"{letter_id}: no such dead letter", file=sys.stderr)
            status = 1
            continue
        print(f"{letter_id}: " + (f"queued again as {entry}" if entry else "job expired; removed"))
    return status


if __name__ == "__main__":
    sys.exit(main())
