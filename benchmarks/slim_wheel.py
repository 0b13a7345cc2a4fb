"""Write a copy of the sglang wheel without what kq's GPU checks never import, so it fits the device
machine's 64 MiB carry beside the tiny model: the Rust server/gRPC/bench extensions (.so, 18 MB,
loaded lazily by SGLang's server only) and the test folders.

    python benchmarks/slim_wheel.py .whl .whl-slim      # copies every wheel, slims sglang's
"""
import shutil
import sys
import zipfile
from pathlib import Path


def dropped(name: str) -> bool:
    return ((name.startswith("sglang/srt/rust_extensions/") and name.endswith(".so"))
            or name.startswith(("sglang/test/", "sglang/multimodal_gen/test/")))


def main(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for whl in sorted(src.glob("*.whl")):
        if not whl.name.startswith("sglang-"):
            shutil.copy(whl, dst / whl.name)
            continue
        with zipfile.ZipFile(whl) as zi, zipfile.ZipFile(dst / whl.name, "w", zipfile.ZIP_DEFLATED) as zo:
            for info in zi.infolist():
                if dropped(info.filename):
                    continue
                data = zi.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):  # pip installs what the RECORD lists
                    data = b"".join(line for line in data.splitlines(True)
                                    if not dropped(line.split(b",")[0].decode()))
                zo.writestr(info, data)
        print(f"{whl.name}: {whl.stat().st_size / 1e6:.1f} MB -> {(dst / whl.name).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
