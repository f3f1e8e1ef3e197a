"""The scripts of the repository's `launchers/` folder as modules, for the console scripts.

In a checkout (or an editable install) this package reads the top-level `launchers/` in place; a
wheel carries copies of those files here (see setup.py). `deepspeed launchers/pretrain.py` and
`python launchers/<name>.py` keep working unchanged.
"""

from pathlib import Path

_checkout = Path(__file__).resolve().parents[2] / "launchers"
if _checkout.is_dir() and (_checkout / "pretrain.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 - a package's __path__ is set by the import system
