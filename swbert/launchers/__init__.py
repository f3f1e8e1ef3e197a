"""The scripts of the repository's `launchers/` folder as modules, for the console scripts.

In a checkout (or an editable install) this package reads the top-level `launchers/` in place; a
wheel carries copies of those files here (see setup.py). `deepspeed launchers/pretrain.py` and
`python launchers/<name>.py` keep working unchanged.
"""

from pathlib import Path

_checkout = Path(__file__).resolve().parents[2] / "launchers"
if _checkout.is_dir() and (_checkout / "pretrain.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 - a package's __path__ is set by the import system


def launcher_path(name: str) -> Path:
    """The file of launcher `name` (e.g. "pretrain"), for commands that start it in new processes."""
    for folder in __path__:  # noqa: F821
        candidate = Path(folder) / f"{name}.py"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"launcher {name}.py is missing from {', '.join(__path__)}: reinstall swbert")  # noqa: F821
