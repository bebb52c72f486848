"""Published configurations of supported checkpoints, usable as ``LLM(model="preset:NAME")``.

Each preset is the ``config.json`` of a Hugging Face checkpoint this engine serves, kept
as ``preset_configs/NAME.json`` (package data) so that model construction, cache sizing
and tests run without downloading anything. The files keep the checkpoint's own field
names, so a preset can also be passed straight to ``transformers.NemotronHConfig`` /
``transformers.GraniteMoeHybridConfig``. Two fields are ours, not the checkpoint's:
``_source`` (the URL of the published config.json) and ``_notes`` (how the values were
obtained, and which were filled in where no complete copy was found).
"""
import json
from importlib import resources

_DIRECTORY = "preset_configs"
_OWN_FIELDS = ("_source", "_notes")


def _files() -> dict:
    """Preset name -> its packaged JSON file (a `Traversable`, also inside a wheel or zip)."""
    folder = resources.files(__package__) / _DIRECTORY
    return {f.name.removesuffix(".json"): f for f in folder.iterdir() if f.name.endswith(".json")}


def preset_names() -> list[str]:
    """The known preset names, sorted."""
    return sorted(_files())


def _read(name: str) -> dict:
    files = _files()
    if name not in files:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(files))}")
    return json.loads(files[name].read_text(encoding="utf-8"))


def get_preset(name: str) -> dict:
    """The named preset's config.json dict (a fresh copy; without our `_source` / `_notes`).

    Raises ValueError naming the known presets if `name` is not one of them.
    """
    return {key: value for key, value in _read(name).items() if key not in _OWN_FIELDS}


def preset_source(name: str) -> str:
    """The URL of the published config.json the named preset reproduces."""
    return _read(name)["_source"]
