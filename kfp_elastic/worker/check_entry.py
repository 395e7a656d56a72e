"""What the master's check (``master/preflight.py``) runs once, in a worker's environment
(its variables, ``PYTHONPATH`` and working directory), before any worker starts:

    python -m kfp_elastic.worker.check_entry RESULT_FILE model-def NAME
    python -m kfp_elastic.worker.check_entry RESULT_FILE module NAME

``model-def``: the model definition loads as the runtime loads it (``load_model_def``: a module
or a ``.py`` file, with every hook it needs) and ``dataset("train")`` has samples. ``module``: a
command's ``-m MODULE`` can be found (``importlib.util.find_spec``; its code is not run).
RESULT_FILE gets ``{"samples": N, "sharded": bool}`` (model-def), ``{}`` (module) or
``{"error": "..."}``; the exit code is 0 either way, so anything else means the check itself
broke.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def _where(error: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost frame outside the import machinery, to point at the
    user's code (a ``SyntaxError`` names its file and line itself)."""
    if isinstance(error, SyntaxError):
        return ""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")
    ]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def check(kind: str, name: str) -> dict[str, Any]:
    if kind == "module":
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as error:
            return {"error": f"-m {name}: {error}"}
        return {} if found is not None else {"error": f"-m {name}: no module named {name!r}"}
    from kfp_elastic.worker.model_def import ModelDefError, load_model_def

    try:
        model_def = load_model_def(name)
    except ModelDefError as error:
        return {"error": str(error)}
    except BaseException as error:  # noqa: BLE001 - the user's code failed while imported
        return {"error": f"--model-def {name}: {type(error).__name__}: {error}{_where(error)}"}
    try:
        samples = len(model_def.dataset("train"))
    except BaseException as error:  # noqa: BLE001
        return {
            "error": f"--model-def {name}: dataset('train') failed: "
            f"{type(error).__name__}: {error}{_where(error)}"
        }
    if samples < 1:
        return {"error": f"--model-def {name}: dataset('train') is empty: nothing to train on"}
    return {"samples": samples, "sharded": model_def.sharded}


def main(argv: list[str]) -> int:
    result_file, kind, name = argv
    Path(result_file).write_text(json.dumps(check(kind, name)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
