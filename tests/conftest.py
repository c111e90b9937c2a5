import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("DS_OMNI_CACHE", str(REPO / ".cache" / "ds_omni"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process, inherited by every rank and launcher the tests start: the
# tensors are tiny, and 2-4 ranks x 2 threads on a 2-core machine spend their time contending.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    import datasets
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    datasets.disable_progress_bars()
