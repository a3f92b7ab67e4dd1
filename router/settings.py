"""``pdpool router`` settings: the flags (``pdpool.config.RouterCommandConfig``) over an optional YAML file, and
the scheduler's plugins.

The YAML file may set any router setting by name (``max_inflight`` or ``max-inflight``) and a ``scheduler``
section; a flag given on the command line wins over the file::

    decode: [http://decode-0:8000, http://decode-1:8000]
    scheduler:
      filters:
        - {type: load-margin-filter, parameters: {marginTokens: 2048}}
      scorers:                      # weight * value, summed
        - {type: prefix-cache-scorer, weight: 3}
        - {type: queue-scorer, weight: 2}
        - {type: kv-usage-scorer, weight: 2}
      picker: {type: max-score-picker}

Without a ``scheduler`` section the defaults above are built from the flags (``--prefix-weight``,
``--queue-weight``, ``--kv-usage-weight``, ``--load-margin-tokens``, ``--picker``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdpool import config
from pdpool.router import filters, pickers, scorers  # noqa: F401  (they register their plugins)
from pdpool.router.plugins import Plugin, build

_SECTION = "router"


class SettingsError(ValueError):
    pass


@dataclass
class SchedulerProfile:
    filters: list[Plugin]
    scorers: list[tuple[Plugin, float]]
    picker: Plugin


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdpool router", description="The pool's OpenAI gateway: prefix- and "
                                "load-aware prefill/decode routing (docs/router.md).")
    config.add_arguments(p, config.RouterCommandConfig)
    return p


def load(argv: list[str], environ: dict | None = None) -> tuple[config.RouterCommandConfig, dict]:
    """(validated config, the YAML's ``scheduler`` section or {}); raises SystemExit on a bad flag."""
    ns = parser().parse_args(config.dashed_flags(argv))   # --max_inflight too, as pdpool serve and vLLM take it
    given = vars(ns)
    scheduler: dict = {}
    path = given.get(f"{_SECTION}.config")
    try:
        if path:   # the same file format as pdpool serve's --config, plus a scheduler section
            data = config.read_config_file(path)
            scheduler = data.pop("scheduler", None) or {}
            if not isinstance(scheduler, dict):
                raise SettingsError(f"--config {path}: 'scheduler' must be a mapping")
            config.merge_config_file(given, data, path, config.RouterCommandConfig)   # flags win
        cfg = config.from_args(argparse.Namespace(**given), config.RouterCommandConfig, environ)
    except (config.ConfigError, TypeError) as exc:
        raise SettingsError(str(exc)) from None
    return cfg, scheduler


def profile(cfg: config.RouterCommandConfig, scheduler: dict) -> SchedulerProfile:
    r = cfg.router
    try:
        if "filters" in scheduler:
            fs = [build(s) for s in scheduler["filters"] or []]
        else:
            fs = [build({"type": "load-margin-filter", "parameters": {"marginTokens": r.load_margin_tokens}})]
        if "scorers" in scheduler:
            ss = [(build(s), float(s.get("weight", 1.0))) for s in scheduler["scorers"] or []]
        else:
            ss = [(build({"type": "prefix-cache-scorer"}), r.prefix_weight),
                  (build({"type": "queue-scorer"}), r.queue_weight),
                  (build({"type": "kv-usage-scorer"}), r.kv_usage_weight)]
        picker = build(scheduler.get("picker") or {"type": f"{r.picker}-picker"})
    except (ValueError, TypeError, AttributeError) as exc:
        raise SettingsError(f"scheduler: {exc}") from None
    for plugin, kind in [(f, "filter") for f in fs] + [(s, "score") for s, _ in ss] + [(picker, "rank")]:
        if not hasattr(plugin, kind):
            raise SettingsError(f"scheduler: {plugin.type_name} is not a {kind} plugin")
    if any(w < 0 for _, w in ss):
        raise SettingsError("scheduler: scorer weights must be >= 0")
    return SchedulerProfile(fs, [(s, w) for s, w in ss if w > 0], picker)
