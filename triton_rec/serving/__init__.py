"""Answering requests: HPS lookups (:mod:`.session`), HugeCTR requests (:mod:`.hugectr_request`,
:mod:`.ranking`) and building a model instance's session (:mod:`.deployment`)."""
