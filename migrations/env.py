"""Alembic environment: the URL comes from the caller (``app.migrate``) or the settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from app.settings import Settings
from app.tables import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or Settings().database


def run() -> None:
    if context.is_offline_mode():
        context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(url)
    with engine.connect() as connection:
        # SQLite cannot ALTER most things in place: batch mode copies the table
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run()
