"""Running luban as another user in tests (root drops to ``nobody`` or any uid with setpriv(1)).

The venv's interpreter lives under /root (mode 700), which another user cannot open: such a child runs
the system's interpreter of the same version (/usr/bin/python3.11 under a 3.11 venv: the venv's
compiled packages are built for it) with this checkout and the venv's site-packages on PYTHONPATH.
Where that user cannot reach those either (a clone in a mode-700 temporary folder, as CI makes), they
are mirrored by hard links (``cp -al``: no data copied, file modes kept) into a folder it can read."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
VENV_SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
# why a test cannot drop to another user here (None: it can)
UNAVAILABLE = (None if os.geteuid() == 0 and SYSTEM_PYTHON.exists() and shutil.which("setpriv")
               else f"needs root to drop to another user (setpriv) and {SYSTEM_PYTHON}")


def nobody_can_read(path: Path) -> bool:
    return subprocess.run([*NOBODY, "test", "-r", str(path)], capture_output=True, timeout=300).returncode == 0


@functools.cache
def code_paths() -> tuple[Path, Path]:
    """(the folder holding ``luban``, the venv's site-packages), or hard-linked mirrors any user can read."""
    if nobody_can_read(ROOT / "luban" / "__init__.py") and nobody_can_read(VENV_SITE):
        return ROOT, VENV_SITE
    mirror = Path(tempfile.mkdtemp(prefix="luban-nonroot-code-"))
    mirror.chmod(0o755)
    atexit.register(shutil.rmtree, mirror, ignore_errors=True)
    (mirror / "src").mkdir()
    subprocess.run(["cp", "-al", str(ROOT / "luban"), str(mirror / "src" / "luban")], check=True, timeout=300)
    subprocess.run(["cp", "-al", str(VENV_SITE), str(mirror / "site")], check=True, timeout=300)
    return mirror / "src", mirror / "site"
