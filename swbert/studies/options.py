"""The options every study shares, declared once and composed into each study's config (as
torchtitan's job config sections or litgpt's argument groups): where it writes and tracks, the
plugins it imports, whether a changed study may run; and, for studies whose points are
pretraining runs (the systems grid, the quality ladder), what those runs train on and how they run.
A study redefines a field only to give it another default."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from swbert.models.plugins import load_plugins
from swbert.runtime.tracking import tracking_uri
from swbert.studies.records import data_identity
from swbert.studies.runner import absolute, absolute_plugins


@dataclass(kw_only=True)
class StudyOptions:
    """Where a study writes and tracks, and what it may import or change."""

    output_dir: Path  # the study's folder: its records, tables and plots
    # MLflow store (default: $MLFLOW_TRACKING_URI, else mlflow.db beside the output folder, shared by
    # every run there; swbert.runtime.tracking)
    tracking_uri: str | None = None
    experiment: str  # MLflow experiment name
    # modules imported first that register attention variants (ours; see swbert.models.plugins):
    # dotted module names or .py files
    plugins: list[str] = field(default_factory=list)
    # run in a folder that holds this study with other options or data: the new points beside the
    # finished ones, which are never relabelled (default: refused, naming what differs)
    allow_study_change: bool = False

    def check(self) -> None:
        load_plugins(self.plugins)

    def store(self) -> str:
        """The MLflow store: --tracking-uri, else `tracking_uri`: $MLFLOW_TRACKING_URI, else the
        mlflow.db beside the output folder (the folder's own one, for a study made before it was shared)."""
        return self.tracking_uri or tracking_uri(self.output_dir)

    def make_absolute(self) -> None:
        """The study's paths made absolute (`absolute`): its runs start in another folder."""
        self.output_dir = absolute(self.output_dir)
        self.plugins = absolute_plugins(self.plugins)


@dataclass(kw_only=True)
class PointOptions(StudyOptions):
    """The options of studies whose points are pretraining runs (`swbert.studies.jobs`)."""

    # named sizes (swbert.models.config.SIZES) or LxW: L layers of width W with 64-dim heads
    sizes: list[str]
    # attention variants (any registered, plugins included)
    attentions: list[str] = field(
        default_factory=lambda: ["standard", "shared"], metadata={"aliases": ("attention",)}
    )
    data_dir: str | None = None  # shards the runs read (default: the embedded default corpus)
    seq_len: int = 128  # tokens per sequence
    micro_batch: int  # sequences per rank per forward pass
    nproc: int  # processes of a run on this machine (torchrun)
    point_timeout_s: float = field(metadata={"aliases": ("point_timeout",)})  # seconds per run
    retry_failed: bool = False  # run points that failed before again (default: keep their reason)
    emit_slurm: bool = False  # write the study as a SLURM job array (OUTPUT_DIR/submit.sh) instead
    gpus_per_node: int  # with --emit-slurm: GPUs per array task (0: CPU nodes, one process each)

    def make_absolute(self) -> None:
        super().make_absolute()
        self.data_dir = absolute(self.data_dir)

    def read_data(self, held_out: bool = False) -> tuple[str, int, dict[str, str]]:
        """The shards the runs read (checked: `swbert.data.folder.prepare_data`), their vocabulary, and
        their manifest's hash as the study's data identity (the manifest holds every shard's hash);
        `held_out`: a ValueError naming --data-dir unless they have a validation split."""
        from swbert.data.folder import prepare_data

        path = Path(prepare_data(self.data_dir)) / "manifest.json"
        manifest = json.loads(path.read_text())
        if held_out and not sum(
            int(s.get("valid", {}).get("documents", 0)) for s in manifest.get("shards", [])
        ):
            raise ValueError(
                f"--data-dir {path.parent}: no validation split (its manifest.json counts 0 validation "
                "documents); the study's held-out loss needs one: preprocess with a validation share "
                "(data_prep.preprocess)"
            )
        return str(path.parent), int(manifest["tokenizer"]["vocab_size"]), data_identity([path])
