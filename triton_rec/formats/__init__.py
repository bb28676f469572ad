"""Files of trained models the engine reads: HugeCTR sparse directories
(:mod:`.hugectr_sparse`), ``.npz`` tables (:mod:`.npz_table`), and the dispatch by path
(:func:`.tables.read_table`, :func:`.tables.write_table`)."""
