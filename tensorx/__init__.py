"""tensorx."""
