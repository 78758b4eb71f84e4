"""What the benchmarks share: the towers they build (models.py), where they run (device.py), the in-process
service (service.py), test images (images.py), one percentile (stats.py), and the setup stamp and result
files every run writes (report.py)."""
