"""The live dashboard at `/dashboard`: one page, its login, the JSON it renders.

- `state`: `DashboardState`, the document the page polls, built from the router's live objects;
- `session`: the signed, expiring cookie a browser carries instead of the admin token, and the
  sessions logged out (refused until their expiry);
- `login_form`: the login form's body read to its `token`, a malformed one a 400 naming why;
- `routes`: the handlers and `add_dashboard_routes`;
- `static/`: `index.html`, `login.html`, `dashboard.js`, `dashboard.css` (package data; no
  external resource: the page works with no network beyond the router).
"""
