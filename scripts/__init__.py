"""Build and proof scripts run as modules from the checkout (`python -m scripts.gpu_proof`)."""
