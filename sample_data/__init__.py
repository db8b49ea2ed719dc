"""Sample inputs and the small bundled models (engine/models/catalogue.py, kind "bundled")."""
