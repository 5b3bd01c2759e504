"""The web admin over the database (/admin on the gateway): operators' own login, views, actions, a live dashboard."""
