"""An MkDocs hook that publishes the benchmarks' figures beside the pages that include their READMEs.

``docs/benchmarks/<name>/index.md`` includes ``benchmarks/<name>/README.md``, whose figures are linked relative to
it (``results/curves.png``). Every image under ``benchmarks/`` is added to the site at its repository path, where
those relative links then point, so the figures stay where the READMEs keep them.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".svg", ".gif"}


def benchmark_images(root: Path) -> list[str]:
    """The images under ``root/benchmarks``, as paths relative to ``root``."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in (root / "benchmarks").rglob("*")
        if path.suffix.lower() in IMAGE_SUFFIXES and "out" not in path.relative_to(root).parts
    )


def on_files(files, config):
    from mkdocs.structure.files import File

    root = Path(config["config_file_path"]).parent
    for path in benchmark_images(root):
        if files.get_file_from_path(path) is None:
            files.append(
                File(
                    path,
                    src_dir=str(root),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files
