"""gpushare's client side: ``gpushare-run`` and the library paths it injects."""
