"""What the user chose, kept per model: sampling, system prompt, K, mode, cache budgets.

One JSON file in the user config folder (`platformdirs.user_config_path("edge0")/models.json`),
keyed by the model's identity (`model_key`): "demo" however the bundled model is named, a Hugging
Face repo id (its cached snapshot folder too), else the local folder's resolved path.
Options given on the command line win over stored ones for that run.

The file is the user's, and treated as hostile like every file: one that is too big, not a regular
file, not JSON or holding values out of range is ignored (field by field where it can be) with a
one-line warning, never a traceback. A file that cannot be read at all is kept aside by the next
save (`models.json.unreadable`), never written over. Writes go to a temp file renamed into place,
so a crash leaves the old file or the new one, and are bounded as reads are: a save that would
make a file too big to read back is refused, and the file stays as it was. Private like the
chats: the folder 0700, the file 0600.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine import MODES, Edge0Error, GenerationConfig, read_json_file, write_json_file

from .chat_store import PRIVATE_DIR, PRIVATE_FILE
from .model_source import DEMO, is_bundled_demo, local_path
from .sanitize import sanitize

FILE_NAME = "models.json"
# A preferences file is a few hundred bytes a model: anything near this is not ours.
MAX_FILE_BYTES = 1 << 20
MAX_SYSTEM_PROMPT_CHARS = 16_000
_GENERATION_FIELDS = ("temperature", "top_p", "max_tokens", "seed")


@dataclass(frozen=True)
class ModelPreferences:
    """A model's stored choices. None: not chosen (the model's or the command's default)."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    system_prompt: str = ""
    k: int | None = None
    mode: str | None = None
    expert_cache_bytes: int | None = None
    # Set when stored: the budget in bytes, or "off"; None: the model's default.
    page_cache: int | str | None = None

    def as_json(self) -> dict:
        out = {name: getattr(self.generation, name) for name in _GENERATION_FIELDS}
        out.update(
            system_prompt=self.system_prompt,
            k=self.k,
            mode=self.mode,
            expert_cache_bytes=self.expert_cache_bytes,
            page_cache=self.page_cache,
        )
        return {key: value for key, value in out.items() if value is not None}


class PreferenceStore:
    """The preferences file. `warning` says why stored values were ignored, for the app to show."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / FILE_NAME
        self.warning: str | None = None

    def load(self, model: str, defaults: GenerationConfig) -> ModelPreferences:
        """`model`'s preferences over `defaults`; what cannot be read is left at its default."""
        stored = (self._read_all() or {}).get(model)
        if stored is None:
            return ModelPreferences(generation=defaults)
        if not isinstance(stored, dict):
            self._warn(f"the entry for {model!r} is not an object")
            return ModelPreferences(generation=defaults)
        return self._parse(stored, defaults)

    def models(self) -> list[str]:
        """The models settings are kept for, by key (`model_key`), in the file's order."""
        return list(self._read_all() or {})

    def save(self, model: str, preferences: ModelPreferences) -> None:
        """Store `model`'s preferences, the other models' kept. A file that could not be read is
        kept aside (`aside_path`), not written over. Raises Edge0Error when the file cannot be
        written, or would be too big to read back; the app shows it and carries on."""
        everything = self._read_all()
        if everything is None:
            self._write_aside({model: preferences.as_json()})
        else:
            self._write({**everything, model: preferences.as_json()})

    def remember(self, model: str) -> None:
        """List `model` among the models used (`edge0 list`, the picker) once it has opened,
        keeping no choice for it: an empty entry, where it has none. A file that could not be
        read is left as it is. Raises Edge0Error when the file cannot be written."""
        everything = self._read_all()
        if everything is None or model in everything:
            return
        self._write({**everything, model: {}})

    def aside_path(self) -> Path:
        """Where a save keeps a settings file it could not read: the first free of
        `models.json.unreadable`, `models.json.unreadable-2`, ..."""
        aside, n = self.path.with_name(f"{FILE_NAME}.unreadable"), 1
        while os.path.lexists(aside):
            n += 1
            aside = self.path.with_name(f"{FILE_NAME}.unreadable-{n}")
        return aside

    def _write(self, everything: dict) -> None:
        # The same bound as `_read_all`'s: a file too big to read back is refused, unwritten.
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
            os.chmod(folder, PRIVATE_DIR)
        except OSError as e:
            raise Edge0Error(f"{self.path}: cannot save the settings ({e.strerror or e})") from None
        document = {"version": 1, "models": everything}
        write_json_file(
            self.path, document, MAX_FILE_BYTES, "the settings", mode=PRIVATE_FILE, indent=2
        )

    def _write_aside(self, everything: dict) -> None:
        """Write `everything` where a file stands that could not be read, that file renamed
        to `aside_path` first (and back, where the new one cannot be written)."""
        aside = self.aside_path()
        try:
            os.rename(self.path, aside)
        except OSError as e:
            raise Edge0Error(
                f"{self.path}: cannot save the settings: cannot keep the unreadable file as "
                f"{aside.name} ({e.strerror or e})"
            ) from None
        try:
            self._write(everything)
        except Edge0Error:
            os.rename(aside, self.path)
            raise

    # -- reading a hostile file --------------------------------------------------------------------

    def _read_all(self) -> dict | None:
        """Every model's entry; None (and `warning` set) when the file cannot be read whole."""
        if not os.path.lexists(self.path):
            return {}
        try:
            data = read_json_file(self.path, "not valid JSON ({})", MAX_FILE_BYTES)
        except Edge0Error as e:
            return self._unreadable(str(e).removeprefix(f"{self.path}: "))
        models = data.get("models") if isinstance(data, dict) else None
        if not isinstance(models, dict):
            return self._unreadable('no "models" object')
        return models

    def _unreadable(self, why: str) -> None:
        self.warning = (
            f"{self.path}: {sanitize(why)[:200]}; using the defaults (the next save keeps this "
            f"file as {self.aside_path().name})"
        )
        return None

    def _parse(self, stored: dict, defaults: GenerationConfig) -> ModelPreferences:
        generation = defaults
        for name in _GENERATION_FIELDS:
            if name in stored:
                try:
                    generation = replace(generation, **{name: stored[name]})
                except (Edge0Error, TypeError) as e:
                    self._warn(f"{name}: {e}")
        prefs = ModelPreferences(generation=generation)
        prompt = stored.get("system_prompt", "")
        if isinstance(prompt, str) and len(prompt) <= MAX_SYSTEM_PROMPT_CHARS:
            if _encodable(prompt):  # a lone surrogate (JSON "\udcff") broke every message
                prefs = replace(prefs, system_prompt=sanitize(prompt))
            else:
                self._warn("system_prompt: not valid Unicode text (a lone surrogate)")
        else:
            self._warn("system_prompt: not a text of at most 16,000 characters")
        k = stored.get("k")
        if k is not None:
            if _is_int(k) and 1 <= k <= 1024:
                prefs = replace(prefs, k=k)
            else:
                self._warn(f"k: {k!r} is not a routing width")
        mode = stored.get("mode")
        if mode is not None:
            if mode in MODES:
                prefs = replace(prefs, mode=mode)
            else:
                self._warn(f"mode: {mode!r} is not one of {', '.join(MODES)}")
        cache = stored.get("expert_cache_bytes")
        if cache is not None:
            if _is_int(cache) and cache > 0:
                prefs = replace(prefs, expert_cache_bytes=cache)
            else:
                self._warn(f"expert_cache_bytes: {cache!r} is not a positive number of bytes")
        page_cache = stored.get("page_cache")
        if page_cache is not None:
            if page_cache == "off" or (_is_int(page_cache) and page_cache >= 0):
                prefs = replace(prefs, page_cache=page_cache)
            else:
                self._warn(f"page_cache: {page_cache!r} is neither a number of bytes nor 'off'")
        return prefs

    def _warn(self, why: str) -> None:
        self.warning = f"{self.path}: {sanitize(why)[:200]}; using the defaults there"


def fit_to_model(
    prefs: ModelPreferences, context_limit: int, defaults: GenerationConfig, path: Path
) -> tuple[ModelPreferences, str | None]:
    """The kept settings checked against the model once it is loaded: a `max_tokens` that does
    not fit its context (every message was refused) falls back to the default, with one warning
    naming the settings file."""
    wanted = prefs.generation.max_tokens
    if wanted < context_limit:
        return prefs, None
    fallback = min(defaults.max_tokens, max(1, context_limit // 2))
    warning = (
        f"{path}: max_tokens={wanted} does not fit this model's context of {context_limit} "
        f"tokens; using {fallback}"
    )
    return replace(prefs, generation=replace(prefs.generation, max_tokens=fallback)), warning


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def model_key(model: str) -> str:
    """The name preferences are stored under: the model's identity, so that the same model named
    two ways shares them. `demo` and the bundled folder (`assets/demo`) are "demo"; a Hugging Face
    repo id and its snapshot folder in the HF cache (`.../models--owner--name/snapshots/REV`) are
    "owner/name"; another local folder is its absolute path; anything else as given."""
    if model == DEMO:
        return DEMO
    local = local_path(model)
    if not local.is_dir():
        return model
    if is_bundled_demo(local):
        return DEMO
    path = local.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        owner_name = path.parent.parent.name.removeprefix("models--").split("--")
        if len(owner_name) == 2:
            return "/".join(owner_name)
    return str(path)


@dataclass
class KeptPreferences:
    """One model's preferences as the app runs: what was loaded, and each change saved at once."""

    store: PreferenceStore
    model: str  # the key (`model_key`)
    current: ModelPreferences
    # Chosen on the command line for this run: the stored K and mode are not applied over them.
    mode_from_command_line: bool = False
    k_from_command_line: bool = False

    def update(self, **changes) -> None:
        """Change and save. Raises Edge0Error when the file cannot be written (kept in memory)."""
        self.current = replace(self.current, **changes)
        self.store.save(self.model, self.current)
