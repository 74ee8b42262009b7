"""Images for the runtimes that run a host directory as ``/`` (bubblewrap, Apptainer): an image given
by path or by name (found in the local image store, ``bundle.py``), the workspace seeded from the
image's own workdir, and what preflight says when images are missing. Kept apart from the runtimes
so the sandbox, Apptainer and preflight word a missing image the same way.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.runtimes.bundle import ImageDir, images_root, read_image_dir, resolve_image_dir, store_name

FILL_STORE = "polar-env images build TASKS --ids ID (a SWE task's image) or polar-env images unpack ARCHIVE --name {image}"

# Images Apptainer pulls or fetches itself rather than reading from a local folder or file.
URI_SCHEMES = ("docker://", "docker-archive://", "oras://", "library://", "shub://", "http://", "https://")


def fill_hint(image: str) -> str:
    if is_path(image):
        return "a root-filesystem directory (scripts/build_rootfs.sh) or an image bundle there"
    return FILL_STORE.format(image=image)


def is_path(image: str) -> bool:
    """A path, not an image name: what is missing is a folder, not a store entry."""
    return image.startswith(("/", "./", "../", "~"))


def local_image(image: str, runtime: str) -> ImageDir:
    """``image`` (a rootfs or bundle folder, or a name in the store) as an ``ImageDir``; a name the
    store lacks is one line naming where it looked and how to fill it."""
    found = resolve_image_dir(image)
    if found is None and is_path(image):
        what = "is not a directory" if os.path.exists(image) else "does not exist"
        raise ConfigError(f"{runtime} image {image} {what}; give {fill_hint(image)}, or an image name "
                          f"from the image store ({images_root()}), in runtime.image")
    if found is None:
        raise ConfigError(f"{runtime} image {image} is neither a directory nor in the image store "
                          f"({images_root() / store_name(image)}); fill the store with {fill_hint(image)}, "
                          "or fix runtime.image")
    return read_image_dir(found)


def missing_local(images: Iterable[str], runtime: str, accepts_files: bool = False) -> str | None:
    """One line listing every image of ``images`` no folder (or, for Apptainer, file or URI) stands
    for, each with the command that fills the store; None when all are there."""
    missing = [i for i in dict.fromkeys(images)
               if not (accepts_files and (i.startswith(URI_SCHEMES) or os.path.isfile(i))) and resolve_image_dir(i) is None]
    if not missing:
        return None

    def why(i: str) -> str:
        if is_path(i):
            return f"{i} does not exist (give {fill_hint(i)}{', or a .sif' if accepts_files else ''})"
        return f"{i} is not in the image store {images_root()} (fill it: {fill_hint(i)})"

    head = f"{runtime} image " if len(missing) == 1 else f"{len(missing)} {runtime} images missing: "
    return f"{head}{'; '.join(why(i) for i in missing)}, runtime {runtime}; fill the store, or fix runtime.image"


def image_workdir(image: ImageDir | None, workdir: str) -> Path | None:
    """The image's own copy of ``workdir`` (``<rootfs>/testbed``) when it is a directory inside the
    rootfs (a link leaving it does not count); None otherwise."""
    if image is None:
        return None
    root = os.path.realpath(image.rootfs)
    real = os.path.realpath(os.path.join(root, workdir.lstrip("/")))
    if real == root or not real.startswith(root + os.sep) or not os.path.isdir(real):
        return None
    return Path(real)


def _member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """``tarfile``'s own checks (no absolute or escaping names, none written through a link that
    leaves ``dest``; a hard link must stay inside), and only files, folders and links at all."""
    if member.islnk():
        return tarfile.data_filter(member, dest)
    if not (member.isfile() or member.isdir() or member.issym()):
        return None  # devices and fifos have no place in a repo
    return tarfile.tar_filter(member, dest)


def extract_stream(stream: io.BufferedReader, dest: Path) -> int:
    """Extract a tar stream (what ``tar -cf - .`` wrote through the image) into ``dest``, member by
    member with ``_member``'s checks: the image's bytes are untrusted. Returns the member count."""
    count = 0
    if not stream.peek(1):
        return 0  # nothing written: the image has no such folder
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            kept = _member(member, str(dest))
            if kept is None:
                continue
            if kept.isdir():  # writable while extracting (extractall defers a folder's mode likewise)
                kept = kept.replace(mode=(kept.mode or 0o755) | 0o700)
            tar.extract(kept, dest, filter="fully_trusted")  # already filtered above
            count += 1
    return count
