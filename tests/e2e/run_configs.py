"""Train several configs one after another in one process, each as `ds-omni train --config C
--deepspeed D` runs it (the CLI's own `main`), so a test of several recipes pays the start-up
(imports, the process group) once. Stops at the first run that fails, with its exit status.

    python -m tests.e2e.run_configs DS_CONFIG CONFIG [CONFIG ...]
"""

from __future__ import annotations

import sys


def run_all(ds_config: str, configs: list[str]) -> int:
    from ds_omni.cli import main
    for config in configs:
        print(f"run_configs: training {config}", flush=True)
        status = main(["train", "--config", config, "--deepspeed", ds_config])
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1], sys.argv[2:]))
