"""sha256 of every file `qpn pack` writes, for every test checkpoint kind (tests/test_cli.py KINDS,
one file and sharded) and the committed ModelOpt fixtures (tests/fixtures/modelopt): the evidence
that a refactor left the packed bytes unchanged (issue 21). Not a speed benchmark.

    python benchmarks/pack_hashes.py [--root CHECKOUT] > hashes.txt

--root runs another checkout's qpn (a git worktree of an older commit) on the same inputs, which
this checkout's tests/test_cli.py builds; diff the two outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=HERE.parent, help="the checkout whose qpn packs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "qpn").symlink_to(args.root.resolve())  # the checkout as the package qpn
        sys.path[:0] = [tmp, str(HERE.parent / "tests")]
        import test_cli  # noqa: PLC0415  (this checkout's checkpoint builder)

        import qpn  # noqa: PLC0415
        from qpn.apps import cli  # noqa: PLC0415

        print(f"# qpn from {Path(qpn.__file__).resolve().parent}", file=sys.stderr)

        sources = {f"{kind}{'-sharded' if sharded else ''}": test_cli.write(Path(tmp), kind, sharded=sharded,
                                                                            name=f"src{int(sharded)}")
                   for kind in test_cli.KINDS for sharded in (False, True)}
        fixtures = HERE.parent / "tests" / "fixtures" / "modelopt"
        sources |= {f"fixture-{p.name}": str(p) for p in sorted(fixtures.iterdir()) if p.is_dir()}
        for name, source in sources.items():
            out = os.path.join(tmp, f"packed-{name}")
            with contextlib.redirect_stdout(io.StringIO()):  # the pack's summary names the temporary folder
                code = cli.main(["pack", source, out, "-q"])
            if code != 0:
                raise SystemExit(f"qpn pack failed on {name}")
            for f in sorted(os.listdir(out)):
                digest = hashlib.sha256(Path(out, f).read_bytes()).hexdigest()
                print(f"{name}/{f} {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
