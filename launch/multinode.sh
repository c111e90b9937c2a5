#!/usr/bin/env bash
# Multi-node training on GPU nodes with the deepspeed launcher.
#   launch/multinode.sh HOSTFILE CONFIG.json DS_CONFIG.json [extra ds-omni train args...]
# Run on the master node (first line of the hostfile); every node needs the same checkout and venv.
set -euo pipefail
HOSTFILE=${1:?hostfile}; CONFIG=${2:?ds_omni config}; DS_CONFIG=${3:?DeepSpeed config}; shift 3
MASTER=$(grep -v '^\s*#' "$HOSTFILE" | awk 'NF {print $1; exit}')
exec deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER" --master_port "${MASTER_PORT:-29500}" \
  --module ds_omni train --config "$CONFIG" --deepspeed "$DS_CONFIG" "$@"
