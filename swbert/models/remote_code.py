"""Make a saved swbert folder load in plain transformers, as Hugging Face custom models do.

`save_loadable(model, folder)` writes a masked-LM folder this way, with a README.md on loading it.
`add_remote_code(folder)` copies the source files that define the model classes into the folder,
with their `swbert` imports rewritten as relative ones, and writes `auto_map` into config.json, so

    AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)

works in a process that never imports swbert (the folder can also be pushed to the Hub as is).
Where swbert is imported, its registered classes are used and the copied code is ignored.

The files are found by following the imports of the modules that define the classes, so the
copy follows the model code as it changes; nothing here lists the model's classes or files.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from swbert.models import SWBertConfig

PACKAGE = "swbert"


def _auto_classes() -> dict[str, type]:
    """The transformers Auto class name -> the swbert class registered for it (see swbert.models)."""
    import swbert.models as models

    return {
        "AutoConfig": models.SWBertConfig,
        "AutoModel": models.SWBertModel,
        "AutoModelForMaskedLM": models.SWBertForMaskedLM,
        "AutoModelForSequenceClassification": models.SWBertForSequenceClassification,
        "AutoModelForQuestionAnswering": models.SWBertForQuestionAnswering,
    }


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute name a `from ... import` refers to, relative forms included."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _swbert_imports(module: str, tree: ast.Module) -> list[tuple[ast.stmt, str]]:
    """(statement, imported module) for every import of a swbert module in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append((node, target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.append((node, alias.name))
    return found


def _file_names(modules: list[str]) -> dict[str, str]:
    """A flat file name per module: its last component, or more of it where two would collide."""
    names: dict[str, str] = {}
    for module in modules:
        parts = module.split(".")
        depth = 1
        while "_".join(parts[-depth:]) in names.values():
            depth += 1
        names[module] = "_".join(parts[-depth:])
    return names


def _closure(roots: list[str]) -> dict[str, tuple[str, ast.Module]]:
    """Every swbert module the roots import, transitively: name -> (source, parsed)."""
    sources: dict[str, tuple[str, ast.Module]] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in sources:
            continue
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ValueError(f"cannot copy {module} into an exported folder: no Python source file")
        if spec.submodule_search_locations is not None:
            raise ValueError(
                f"{module} is a package; model code must import from the module that defines a name "
                f"(e.g. `from {module}.config import ...`) so that only model files are exported"
            )
        text = Path(spec.origin).read_text()
        tree = ast.parse(text)
        sources[module] = (text, tree)
        todo.extend(target for _, target in _swbert_imports(module, tree))
    return sources


def _rewrite(module: str, text: str, tree: ast.Module, files: dict[str, str]) -> str:
    """The module's source with each swbert import replaced by a relative one to the copied file."""
    lines = text.splitlines(keepends=True)
    edits = []
    for node, target in _swbert_imports(module, tree):
        if not isinstance(node, ast.ImportFrom):
            raise ValueError(
                f"{module} line {node.lineno}: `import {target}` cannot become a relative import; "
                f"write `from {target} import NAME` instead"
            )
        names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
        indent = lines[node.lineno - 1][: node.col_offset]
        edits.append(
            (node.lineno, node.end_lineno or node.lineno, f"{indent}from .{files[target]} import {names}\n")
        )
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start - 1 : end] = [replacement]
    return "".join(lines)


def add_remote_code(folder: str | Path) -> dict[str, str]:
    """Copy the model code into a saved folder and point config.json's `auto_map` at it.

    Returns the auto_map written. The folder must hold a config.json (save_pretrained first).
    """
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} holds no config.json; call save_pretrained({str(folder)!r}) first")
    classes = _auto_classes()
    sources = _closure(sorted({cls.__module__ for cls in classes.values()}))
    files = _file_names(sorted(sources))
    for module, (text, tree) in sources.items():
        (folder / f"{files[module]}.py").write_text(_rewrite(module, text, tree, files))
    auto_map = {auto: f"{files[cls.__module__]}.{cls.__name__}" for auto, cls in classes.items()}
    config = json.loads(config_file.read_text())
    config["auto_map"] = auto_map
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return auto_map


def save_loadable(model: PreTrainedModel, folder: str | Path) -> Path:
    """Every masked-LM folder swbert writes (an export, a merged tensor-parallel checkpoint, a
    converted BERT): the weights as safetensors, the model's code and `auto_map`, and a README.md
    on loading it. The caller adds the tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    add_remote_code(folder)
    (folder / "README.md").write_text(model_card(model.config))
    return folder


def model_card(config: SWBertConfig) -> str:
    """README.md of an exported folder: what the model is and how to load it, with or without swbert."""
    lines = [
        f"# swbert masked language model ({config.attention_type} attention)",
        "",
        f"{config.num_hidden_layers} layers, hidden size {config.hidden_size}, "
        f"{config.num_attention_heads} heads, vocabulary {config.vocab_size}; trained with swbert.",
        "",
        "## Loading",
        "",
        "Anywhere transformers is installed (the model code is in this folder):",
        "",
        "```python",
        "from transformers import AutoModelForMaskedLM, pipeline",
        'model = AutoModelForMaskedLM.from_pretrained("THIS_FOLDER", trust_remote_code=True)',
        'fill = pipeline("fill-mask", model="THIS_FOLDER", trust_remote_code=True)',
        "```",
        "",
        "With swbert installed, `import swbert` first: its registered classes are used and",
        "`trust_remote_code` is not needed.",
        "",
    ]
    from swbert.models.attention import attention_class

    if attention_class(config.attention_type).bert_equivalent and not config.bert_differences():
        lines += [
            "## As transformers' BertForMaskedLM",
            "",
            f"The `{config.attention_type}` variant is numerically BERT. Convert it once, then load it with",
            "transformers alone:",
            "",
            "```bash",
            "swbert-convert to-hf THIS_FOLDER bert/   # or: python -m swbert.convert to-hf THIS_FOLDER bert/",
            "```",
            "",
            "```python",
            "from transformers import BertForMaskedLM",
            'model = BertForMaskedLM.from_pretrained("bert/")',
            "```",
            "",
        ]
    else:
        what = ", ".join([f"the `{config.attention_type}` attention", *config.bert_differences()])
        lines += [
            f"This model ({what}) has no transformers BERT equivalent, so it has no",
            "BertForMaskedLM conversion; the code in this folder is the reference.",
            "",
        ]
    return "\n".join(lines)
