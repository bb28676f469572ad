"""Small helpers every layer may use: rate-limited logging, /proc readers."""
