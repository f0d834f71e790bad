"""Dataset preparation: tokenize text, pack it into fixed-length rows, write Parquet shards + manifest.json.

``raytrn.data.manifest`` (light: no Ray, no torch) describes and validates a prepared dataset;
``raytrn.data.packing`` packs token streams into rows; ``raytrn.data.prepare`` runs the whole job.
"""
