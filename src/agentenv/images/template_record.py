"""An image template's record (``template.json``): the image's source, manifest digest,
layers, run config and how its layers are loaded, with the defaults `docker run`
would give its processes."""

from __future__ import annotations

import time
import uuid

from .manifest import Image


def template_record(name: str, ref: str, image: Image, lazy: bool,
                    unpacked_sizes: list[int]) -> dict:
    return {
        "templateID": name, "aliases": [name], "cpuCount": 2, "memoryMB": 512,
        "createdAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "buildID": str(uuid.uuid5(uuid.NAMESPACE_URL, image.manifest_digest)),
        "image": {
            "source": ref, "manifestDigest": image.manifest_digest,
            "layers": [{"digest": x.digest, "size": x.size, "unpackedSize": n}
                       for x, n in zip(image.layers, unpacked_sizes, strict=True)],
            "config": image.run_config,
            # Kept: the image's later starts, on any node, load it the same way.
            "loading": "lazy" if lazy else "unpack",
        },
        # What `docker run` would give the image's processes.
        **run_defaults(image.run_config),
    }


def run_defaults(config: dict) -> dict:
    """The template defaults an image's config implies: its ENV, WORKDIR and USER."""
    envs = dict(item.split("=", 1) for item in config.get("env", []) if "=" in item)
    out: dict = {"envs": envs} if envs else {}
    if config.get("workdir"):
        out["defaultWorkdir"] = config["workdir"]
    # ``USER name:group``: envd takes the user's own group.
    user = str(config.get("user") or "").split(":")[0]
    out["defaultUser"] = user or "root"
    return out
