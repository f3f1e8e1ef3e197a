"""Build hook: the wheel carries the repository's ds_configs/ and launchers/ inside the package.

Both stay top-level folders in the repository (where users edit DeepSpeed configs and where
`deepspeed launchers/pretrain.py` is run); a non-editable install gets copies as
`swbert/ds_configs/*.json` and `swbert/launchers/*.py`, so a run from any directory finds the
shipped configs and the console scripts find the launchers. Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
COPIED = {"ds_configs": "*.json", "launchers": "*.py"}


class BuildWithRepositoryFolders(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the folders in place
        for folder, pattern in COPIED.items():
            target = Path(self.build_lib) / "swbert" / folder
            target.mkdir(parents=True, exist_ok=True)
            for source in sorted((ROOT / folder).glob(pattern)):
                if source.name != "__init__.py":
                    shutil.copy2(source, target / source.name)


setup(cmdclass={"build_py": BuildWithRepositoryFolders})
