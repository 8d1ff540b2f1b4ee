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
from pathlib import Path

from blake3 import blake3

from jukebox.booth import isolation
from jukebox.tape.tapedir import KEPT_SCRATCH, TapeDir


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
    """Removes a booth's scratch dir whatever its supervisor left, and its kept scratch, now;
    what cannot be removed stays for the next opening of the tape dir."""
    from shadowfs.removal import remove_quietly

    remove_quietly(tapes.state / "scratch" / booth_id)
    remove_quietly(tapes.kept_path / booth_id)


def keep_scratch(tapes: TapeDir, booth_id: str, state_fd: int) -> bool:
    """At a pending booth's end, once its layer is gone: its scratch dir is kept until its
    commit or discard (docs/booth.md, "A pending booth's scratch"), made private for good and
    moved to ``.jukebox/kept/<booth_id>``. Private: an overlay's upper dir holds the agent's
    files with the modes and owners it gave them (a setuid copy of a shell, a world-readable
    file), and out of the booth's namespace no nosuid bind covers them any more; so every
    directory becomes 0700, every file keeps at most its owner's read and write bits, all
    owned by this process's user, and a file with other links is unlinked (see
    `shadowfs.privacy.make_private_tree`: nothing is followed). Moved: the tape dir's
    tightening on opening walks kept/ whole, while a running booth's scratch/<id> is only
    ever the supervisor's. ``state_fd`` is the state dir opened on the host's mounts: the
    namespace's bind of scratch/ is another mount, which a rename cannot leave.

    False when it could not be made private or moved: then it is removed now, as before."""
    from shadowfs.privacy import make_private_tree

    name = f"scratch/{booth_id}"
    # As root (or a user namespace's root): every file the agent chowned is taken back.
    owner = (os.geteuid(), os.getegid()) if os.geteuid() == 0 else None
    try:
        make_private_tree(name, dir_fd=state_fd, owner=owner)
        with contextlib.suppress(FileExistsError):
            os.mkdir(KEPT_SCRATCH, 0o700, dir_fd=state_fd)
        os.rename(name, f"{KEPT_SCRATCH}/{booth_id}", src_dir_fd=state_fd, dst_dir_fd=state_fd)
    except OSError:
        remove_scratch(tapes, booth_id)
        return False
    return True


def retire_scratch(tapes: TapeDir, booth_id: str) -> None:
    """Frees a committed booth's kept scratch in a detached process, as a commit's trash
    (`TapeDir.retire_kept`); a scratch dir its supervisor, killed at its end, did not get to
    keep is removed now."""
    from shadowfs.removal import remove_quietly

    remove_quietly(tapes.state / "scratch" / booth_id)
    tapes.retire_kept(booth_id)
