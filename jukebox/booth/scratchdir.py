"""Where a booth's layer stages the agent's files: a private, nosuid, nodev scratch dir.

The overlay backend's upper dir holds the agent's files with their real modes and owners: a
`chmod 4755` copy of bash made by a root agent is a root-owned setuid file on the host's disk.
Two things keep it from any other local user while the booth runs:

- `<tape dir>/.jukebox/` and `.jukebox/scratch/` are 0700, so nobody else can even traverse to
  it (the real protection: it holds on the host, where the file is).
- In the supervisor's own mount namespace the scratch dir is a bind of itself with nosuid and
  nodev, so every path there to a staged file honours neither set-id bits nor device nodes.

The FUSE backend stages files as 0600 scratch files of the supervisor (their modes live in the
layer's inode table, never on disk), in the same dir.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from blake3 import blake3

from jukebox.booth import isolation
from jukebox.tape.tapedir import TapeDir


def layer_mountpoint(tapes: TapeDir, booth_id: str, *, make: bool = False) -> Path:
    """``.jukebox/mnt/<booth_id>``: where the supervisor mounts the booth's layer, never over
    the tree's own path (see `isolation.ChildSpec.mount_at`). In the tape dir's private state:
    never inside the tree (a run refuses overlapping ones), so the layer reading its base
    through a directory fd can never step onto its own mount, and hidden from the agent."""
    return tapes.private_dir("mnt", booth_id) if make else tapes.state / "mnt" / booth_id


def socket_dir_prefix(tape_dir: Path, booth_id: str) -> str:
    """The name prefix of the booth's control socket directory in /tmp: a digest of the tape dir
    and the booth id. Fixed length, so a 128-byte booth id still fits a socket path's 108 bytes;
    and one booth's own, so the clean-up after a killed supervisor never removes the mount point
    of a booth with the same id in another tape dir (an rmdir on the host detaches the mount
    in that booth's namespace), nor of an id it is a prefix of."""
    # BLAKE3, the store's hash (loaded already): hashlib's import is OpenSSL's initialisation.
    digest = blake3(f"{os.path.realpath(tape_dir)}\0{booth_id}".encode()).hexdigest(length=8)
    return f"jukebox-{digest}-"


def booth_scratch(tapes: TapeDir, booth_id: str) -> Path:
    """``.jukebox/scratch/<booth_id>`` (not created), its parents made 0700, and the scratch
    dir bound nosuid,nodev onto itself. Call it inside the booth's private mount namespace:
    the bind is invisible to the host and dies with the namespace."""
    scratch = tapes.private_dir("scratch")
    path = str(scratch)
    try:
        isolation.mount(path, path, None, isolation.MS_BIND)
        isolation.mount_setattr(path, isolation.MOUNT_ATTR_NOSUID | isolation.MOUNT_ATTR_NODEV)
    except OSError as error:
        raise isolation.IsolationError(
            f"cannot bind the booth's scratch dir {path} nosuid,nodev ({error.strerror}): "
            "it needs bind mounts and mount_setattr (Linux 5.12) in the booth's namespace"
        ) from error
    return scratch / booth_id


def remove_scratch(tapes: TapeDir, booth_id: str) -> None:
    """Removes a booth's scratch dir whatever its supervisor left: an overlay's work dir is
    mode 000 (an unprivileged booth's, owned by its user, cannot be walked into until it is
    given its owner's bits back). Nothing is followed out of the dir."""
    path = tapes.state / "scratch" / booth_id
    for root, dirs, _files in os.walk(path):
        for name in dirs:
            child = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(child).st_mode):  # not a symlink to a directory
                    os.chmod(child, 0o700)
    import shutil  # with bz2 and lzma: not at every start of a booth, whose end may not need it

    shutil.rmtree(path, ignore_errors=True)
