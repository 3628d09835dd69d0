"""A PEP 517 build backend with no dependencies: builds the pure-Python wheel of `shard` (and an
sdist) with the standard library only, so `pip install client/python` needs no network."""
import base64
import hashlib
import io
import os
import tarfile
import zipfile

NAME, VERSION = "shard", "0.1.0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "py3-none-any"


def _metadata():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
            "Summary: Python binding of libshard (shardd client) with a PyTorch wrapper\n"
            "Requires-Python: >=3.9\nDescription-Content-Type: text/markdown\n\n" + readme)


def _package_files():
    pkg = os.path.join(ROOT, NAME)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            yield f"{NAME}/{name}", open(os.path.join(pkg, name), "rb").read()


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _write_wheel(wheel_directory, files):
    """The wheel of these (path, bytes) files plus METADATA, WHEEL and RECORD; its name."""
    dist = f"{NAME}-{VERSION}.dist-info"
    files = files + [(f"{dist}/METADATA", _metadata().encode()),
                     (f"{dist}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: shard-backend\n"
                                        f"Root-Is-Purelib: true\nTag: {TAG}\n").encode())]
    record = [_record_line(p, d) for p, d in files] + [f"{dist}/RECORD,,"]
    files.append((f"{dist}/RECORD", ("\n".join(record) + "\n").encode()))
    name = f"{NAME}-{VERSION}-{TAG}.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files:
            z.writestr(path, data)
    return name


def _origin():
    """shard/_origin.py: the source tree the package was built from (pip install client/python
    in a checkout), so that the installed package finds that tree's build of libshard"""
    tree = os.path.dirname(os.path.dirname(ROOT))
    if not os.path.exists(os.path.join(tree, "client", "shard.c")):
        return []
    text = ("# written by the build backend: the shardd source tree this package was built "
            f"from\nSOURCE_TREE = {tree!r}\n")
    return [(f"{NAME}/_origin.py", text.encode())]


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = f"{NAME}-{VERSION}.dist-info"
    return _write_wheel(wheel_directory, list(_package_files()) + _origin() +
                        [(f"{dist}/top_level.txt", f"{NAME}\n".encode())])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """A wheel whose .pth file puts this source folder on sys.path."""
    return _write_wheel(wheel_directory, [(f"__editable__.{NAME}.pth", (ROOT + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{VERSION}"
    name = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for rel in ["pyproject.toml", "README.md", "_build/backend.py"] + \
                [p for p, _ in _package_files()]:
            t.add(os.path.join(ROOT, rel), arcname=f"{base}/{rel}")
        info = _metadata().encode()
        ti = tarfile.TarInfo(f"{base}/PKG-INFO")
        ti.size = len(info)
        t.addfile(ti, io.BytesIO(info))
    return name


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []
