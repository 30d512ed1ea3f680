"""Build tokenmill's C++ kernels for this CPU's own level, then for each level below it that tests/paths runs, one
after another, each in a process of its own (the level is read at import: TOKENMILL_CPU_ISA). scripts/dev.sh runs
this beside its install and the static checks, so that the compiles (a minute a level on 2 cores) use the cores
those leave idle; it needs torch and ninja alone (run as `PYTHONPATH=. python scripts/build_kernels.py` before the
package is installed). A build that fails here is tried again by the tests, which say why. Exits 1 if one failed."""

from __future__ import annotations

import os
import subprocess
import sys

from tokenmill import cpu

LOAD = "import sys; from tokenmill import kernels; sys.exit(0 if kernels.load() else 1)"


def main() -> int:
    levels = cpu.supported_levels()
    failed = []
    for level in [None, *levels[:-1]]:  # None: the machine's own level, as the server builds it
        env = dict(os.environ)
        env.pop(cpu.ISA_ENV, None)
        if level is not None:
            env[cpu.ISA_ENV] = level
        if subprocess.run([sys.executable, "-c", LOAD], env=env).returncode != 0:
            failed.append(level or "own")
    if failed:
        print(f"kernels not built for: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
