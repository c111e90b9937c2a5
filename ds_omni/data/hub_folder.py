"""A local copy of a hub dataset (`snapshot_download`'s layout): data files in folders and a
README.md whose YAML front matter lists `configs` (config_name, data_files per split), or with
none, shards named by split (`data/train-00000-of-00002.parquet`). `datasets` resolves which files
a config's split holds, as `load_dataset` would, from the folder alone (no request to the hub); the rows are then read by `sources.py`'s readers like any other files.
"""

from __future__ import annotations

from pathlib import Path

from ds_omni.config import SourceConfig
from ds_omni.errors import DataError


def hub_configs(folder: Path) -> bool:
    """The folder is a hub dataset snapshot whose README's YAML front matter lists `configs`."""
    readme = folder / "README.md"
    if not readme.is_file():
        return False
    text = readme.read_text(errors="replace")
    return text.startswith("---") and "\nconfigs:" in text.split("\n---", 1)[0]


def hub_files(cfg: SourceConfig, folder: Path) -> list[str]:
    """The files of split `cfg.split` of config `cfg.config` of a local hub dataset snapshot, as
    `datasets` resolves its README's `configs` (a local folder: nothing goes to the hub)."""
    import datasets
    where = f"data source '{cfg.name}'"
    try:
        builder = datasets.load_dataset_builder(str(folder), name=cfg.config)
    except ValueError as e:  # an unknown config lists the ones there are
        raise DataError(f"{where}: {folder}: {e}; set the source's config to one of them") \
            from None
    splits = {k: list(v) for k, v in (builder.config.data_files or {}).items()}
    if cfg.split not in splits:
        raise DataError(f"{where}: config {builder.config.name!r} of {str(folder)!r} has splits "
                        f"{sorted(splits)}, not {cfg.split!r}; set the source's split to one of "
                        "them")
    return sorted(splits[cfg.split])
