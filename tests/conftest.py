import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("DS_OMNI_CACHE", str(REPO / ".cache" / "ds_omni"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    import datasets
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    datasets.disable_progress_bars()
