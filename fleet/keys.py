"""API keys: make, list and revoke them.

    python -m fleet.keys create --name team-a [--scopes jobs,batches] [--rpm 600]
                                [--tpm 200000] [--max-queued 500]
    python -m fleet.keys list
    python -m fleet.keys revoke KEY_ID_OR_NAME

`create` prints the key alone on stdout (so `KEY=$(python -m fleet.keys create ...)` works)
and what it is on stderr; the key is shown this once: Redis keeps only its hash. Limits
left out follow the fleet's KEY_RPM, KEY_TPM and KEY_MAX_QUEUED; 0 means none. Revoking
takes effect on the key's next request. Scopes: jobs, batches, admin (everything).
"""

from __future__ import annotations

import argparse
import json
import sys

from shared.api_keys import ApiKeyStore, parse_scopes
from shared.settings import get_settings


def main(argv: list[str] | None = None, prog: str = "python -m fleet.keys") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="make a key and print it (once)")
    create.add_argument("--name", required=True)
    create.add_argument("--scopes", default="jobs,batches", help="comma-separated")
    for limit, what in (
        ("--rpm", "requests per minute"),
        ("--tpm", "generated tokens per minute"),
        ("--max-queued", "unfinished interactive jobs"),
    ):
        create.add_argument(limit, type=_count, default=None, help=f"{what} (0: no limit)")
    sub.add_parser("list", help="print every key as JSON lines (never the key itself)")
    revoke = sub.add_parser("revoke", help="delete a key by id, or every key of a name")
    revoke.add_argument("key")
    args = parser.parse_args(argv)

    store = ApiKeyStore.from_settings(get_settings())
    if args.command == "create":
        try:
            scopes = parse_scopes(args.scopes)
        except ValueError as exc:
            parser.error(str(exc))
        made = store.create(
            args.name, scopes, rpm=args.rpm, tpm=args.tpm, max_queued=args.max_queued
        )
        print(made.secret)
        print(
            f"made {made.key.id} '{args.name}' ({', '.join(sorted(scopes))}); the key above is "
            "shown once: keep it",
            file=sys.stderr,
        )
        return 0
    if args.command == "list":
        for key in store.list():
            print(json.dumps(key.public()))
        return 0
    found = store.find(args.key)
    if not found:
        print(f"no API key with id or name '{args.key}'", file=sys.stderr)
        return 1
    for key in found:
        store.revoke(key.id)
        print(f"revoked {key.id} '{key.name}'")
    return 0


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


if __name__ == "__main__":
    sys.exit(main())
