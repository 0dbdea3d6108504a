#!/bin/sh
# Dev container feature: gpushare in the image (docs/containers.md).
#
# Use: copy this folder to .devcontainer/gpushare, put gpushare's wheel in it
# (pip wheel --no-deps -w .devcontainer/gpushare PATH/TO/gpushare-source, by the
# image's Python version on a glibc no newer than the image's), and in
# devcontainer.json:
#
#   "features": {"./gpushare": {"python": "/opt/conda/bin/python"}},
#   "runArgs": ["--gpus=all"],
#   "mounts": [{"type": "bind", "source": "/run/gpushare/envs/ENV",
#               "target": "/run/gpushare"}]
#
# ENV is the team's environment (`nodemgr quota set ENV ...` on the host; the
# source is nodemgr's run_dir/envs/ENV). The mount is not declared by this
# feature because a feature's mounts are fixed strings: options reach only this
# script, at build time, and cannot name the environment. All GPUs are passed
# in: grants name them by UUID, and gpushare sets CUDA_VISIBLE_DEVICES per task.
#
# The image's gpushare must come from the same release as the node's nodemgr.
set -eu

# containerEnv may already be in force for this step, naming a shim that does
# not exist yet: keep the loader from complaining about it in every command.
unset LD_PRELOAD

here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
wheel=${WHEEL:-}

if ! command -v "$py" >/dev/null 2>&1; then
    echo "gpushare feature: no '$py' in the image; set the feature's python option" \
        "to the interpreter the frameworks use" >&2
    exit 1
fi
if [ -z "$wheel" ]; then
    set -- "$here"/gpushare-*.whl
    if [ "$#" -ne 1 ] || [ ! -e "$1" ]; then
        echo "gpushare feature: put exactly one gpushare-*.whl in $here," \
            "or name it with the wheel option" >&2
        exit 1
    fi
    wheel=$1
else
    case $wheel in /*) ;; *) wheel=$here/$wheel ;; esac
fi

# From the file, never by name: the package index's "gpushare" is another
# project. -I below: a gpushare source tree in the working directory must not
# shadow what was just installed.
"$py" -m pip install --no-cache-dir --find-links "$here" "$wheel"

# containerEnv cannot run a command, and the shim's path depends on where pip
# put the package: a link gives it the fixed path LD_PRELOAD names.
shim=$("$py" -I -c 'import gpushare.libs as l; print(l.shim_path())')
mkdir -p /usr/local/lib/gpushare
ln -sf "$shim" /usr/local/lib/gpushare/libgpushare.so
scripts=$("$py" -I -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
if [ "$scripts" != /usr/local/bin ]; then
    ln -sf "$scripts/gpushare-run" /usr/local/bin/gpushare-run
fi

# The ids that must match nodemgr's env."ENV".owner or group, as the host sees
# them (a user namespace shifts them; VS Code may change them to the host
# user's at container creation).
user=${_REMOTE_USER:-root}
if id "$user" >/dev/null 2>&1; then
    echo "gpushare: $user is uid $(id -u "$user"), gid $(id -g "$user") in the image;" \
        "the environment's socket and ledger must be open to them (docs/containers.md)"
fi
