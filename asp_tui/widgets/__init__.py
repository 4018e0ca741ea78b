"""The dashboard's panels, one module per area of the screen."""
