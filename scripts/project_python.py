"""Lets the Python scripts of scripts/ run with any python3: a script that needs packages the running
interpreter lacks runs itself again with the virtual environment scripts/setup.sh makes
($STROBE_VENV, default ~/.cache/strobe/venv), so `python3 scripts/NAME.py ...` works as written."""
import importlib.util
import os
import sys


def require(*modules):
    """Returns when every module imports here; else re-executes the script under the project's
    virtual environment, or exits 2 with one line saying how to get the modules."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    venv = os.environ.get("STROBE_VENV") or os.path.expanduser("~/.cache/strobe/venv")
    python = os.path.join(venv, "bin", "python")
    script = os.path.basename(sys.argv[0])
    if os.path.realpath(sys.prefix) != os.path.realpath(venv) and os.access(python, os.X_OK):
        os.execv(python, [python] + sys.argv)
    print(f"{script}: needs {', '.join(missing)}, which {sys.executable} lacks and no virtual environment at {venv} "
          f"has: run scripts/setup.sh (it makes one) or set STROBE_VENV", file=sys.stderr)
    sys.exit(2)
