"""jsteer.data: files -> records -> padded static-shape batches.

* :mod:`jsteer.data.readers`  parsers (CoNLL, labeled text, LAMA) whose errors name file and line.
* :mod:`jsteer.data.ner`      IOB1 -> IOB2, word -> subword label alignment.
* :mod:`jsteer.data.tfds_builders`  TFDS builders writing array_record (no TensorFlow needed),
  read back by index with ``tfds.data_source``-style sources; cached by the sources' content.
* :mod:`jsteer.data.sources`  what the method pipelines read: raw files prepared through the
  builders, or a prepared TFDS data set by name (``open_tfds``), as the readers' record types.
* :mod:`jsteer.data.digest`   content hashes of source files (the cache key), remembered per file.
* :mod:`jsteer.data.buckets`  the one rule that rounds lengths / sizes up to static shapes.
* :mod:`jsteer.data.batching` bucketed padding and a deterministic, resumable batch iterator.

Submodules are imported on demand (tensorflow-datasets is slow to import).
"""
