"""Small stand-ins for a job's inputs, enough for ``validate``'s path rules: an HF checkpoint directory with the
files they look for (config.json as given, empty weights and processor files) and a jsonl data set."""

import json
from pathlib import Path


def write_hf_dir(directory: Path, config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or {}))
    for name in ("model.safetensors", "tokenizer.json", "preprocessor_config.json", "chat_template.jinja"):
        (directory / name).write_text("")
    return directory


def write_rows(path: Path, rows: int, answer_key: str = "answer") -> Path:
    """``rows`` text-only jsonl rows (a row needs no image to be usable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1 = ?", answer_key: str(i + 1)}) + "\n"
                            for i in range(rows)))
    return path


def write_data_dir(directory: Path, rows: int = 64, splits: tuple[str, ...] = ("train", "test")) -> Path:
    for split in splits:
        write_rows(directory / f"{split}.jsonl", rows)
    return directory
