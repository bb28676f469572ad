"""Configuration: ``ps.json`` (:mod:`.ps_json`), ``config.pbtxt`` (:mod:`.model_config`),
and how model files are found, confined and read (:mod:`.model_files`)."""
