"""`kvfence keys`: make, list and revoke a PD cluster's CURVE keys (kvfence/pd/keys.py, docs/security.md).

kvfence keys init DIR [--prefill N] [--decode M]   the router's pair and one pair per worker
kvfence keys add DIR ROLE NAME                     one more worker's pair
kvfence keys revoke DIR ROLE NAME                  move NAME's public key out of the allowlist
kvfence keys list DIR                              who is allowed, and which secrets lie here
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfence.pd import keys


def add_keys_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="make, list and revoke the PD cluster's keys (docs/security.md)")
    ks = p.add_subparsers(dest="keys_command", required=True)
    q = ks.add_parser("init", help="write the router's key pair and one per worker (secrets mode 0600)")
    q.add_argument("dir", type=Path)
    q.add_argument("--prefill", type=int, default=1, help="prefill workers (keys prefill-0, prefill-1, ...)")
    q.add_argument("--decode", type=int, default=1, help="decode workers (keys decode-0, decode-1, ...)")
    q = ks.add_parser("add", help="one more worker's key pair; the router accepts it at once")
    q.add_argument("dir", type=Path)
    q.add_argument("role", choices=keys.ROLES)
    q.add_argument("name")
    q = ks.add_parser("revoke", help="take a worker's public key out of the allowlist (the router drops it)")
    q.add_argument("dir", type=Path)
    q.add_argument("role", choices=keys.ROLES)
    q.add_argument("name")
    q = ks.add_parser("list", help="the allowlist, and which secret keys lie in DIR")
    q.add_argument("dir", type=Path)
    p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    try:
        return int(_run(args))
    except (keys.KeyFileError, ValueError) as exc:
        print(f"kvfence keys {args.keys_command}: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    if args.keys_command == "init":
        if args.prefill < 1 or args.decode < 1:
            raise ValueError("--prefill and --decode must be at least 1")
        written = keys.init(
            directory,
            [f"prefill-{i}" for i in range(args.prefill)],
            [f"decode-{i}" for i in range(args.decode)],
        )
        print(f"wrote {len(written)} key pairs in {directory}:")
        for path in written:
            print(f"  {path}")
        print(_HOSTS.format(dir=directory))
    elif args.keys_command == "add":
        print(f"wrote {keys.add(directory, args.role, args.name)}")
    elif args.keys_command == "revoke":
        public = directory / args.role / f"{args.name}.key"
        if not public.exists():
            raise keys.KeyFileError(public, "no such key")
        revoked = directory / "revoked"
        revoked.mkdir(mode=0o700, exist_ok=True)
        public.rename(revoked / f"{args.role}-{args.name}.key")
        print(f"revoked {args.role}/{args.name}: the router drops it within a second (or on SIGHUP)")
    else:
        for principal, (role, name) in sorted(keys.allowlist(directory).items(), key=lambda kv: kv[1]):
            secret = directory / role / f"{name}.key_secret"
            print(f"{role:8} {name:20} {principal}  secret {'here' if secret.exists() else 'not here'}")
    return 0


_HOSTS = """
What each host needs (copy nothing else; docs/security.md):
  router host   {dir}/router.key_secret, router.key, prefill/*.key, decode/*.key
  prefill host  {dir}/router.key, its own prefill/NAME.key_secret, decode/*.key
  decode host   {dir}/router.key, its own decode/NAME.key_secret
Then start each with --cluster-keys DIR (workers: --cluster-key NAME when DIR holds several of their role)."""
