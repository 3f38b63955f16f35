"""The ``secagg`` command, presets, run directories, reports and plots. Nothing imports this package."""
