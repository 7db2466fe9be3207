# The Remat service image: the API (uvicorn), the Celery worker and (built with
# EXTRAS=agent) the node agent all run from it (docker-compose.yml picks the command).
#
# The source tree stays at /srv/remat and is installed in editable mode: app/migrate.py and
# `alembic upgrade head` find alembic.ini and migrations/ next to the app package.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    REMAT_DATA_DIR=/data

WORKDIR /srv/remat

# Dependencies first, from pyproject.toml alone, so that a source change keeps this layer.
# EXTRAS names optional groups to add (the agent image: EXTRAS=agent).
ARG EXTRAS=""
COPY pyproject.toml ./
RUN python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e for e in sys.argv[1].split(',') if e]; print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" "$EXTRAS" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .
RUN pip install --no-deps -e . \
    && useradd --system --create-home --home-dir /home/remat remat \
    && mkdir -p /data \
    && chown remat:remat /data

# A fresh named volume mounted on /data takes this directory's owner.
VOLUME ["/data"]
USER remat
EXPOSE 8642

CMD ["uvicorn", "--factory", "app.main:create_app", "--host", "0.0.0.0", "--port", "8642"]
