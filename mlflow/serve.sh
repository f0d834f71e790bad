#!/usr/bin/env bash
# Start the team MLflow tracking server in the foreground (systemd, nohup or a terminal runs it).
# Needs only `mlflow` (pip install 'mlflow[auth]>=3.16.1,<4'); see mlflow/README.md.
#
# Usage: mlflow/serve.sh [--workers N] [--dry-run] [-- EXTRA `mlflow server` OPTIONS]
#   --dry-run  check the settings, write the auth ini, print the command instead of running it
#
# Settings from the environment (MLflow's own variable names where it has one):
#   MLFLOW_DATA_DIR               server state: sqlite database, artifacts, auth ini + users db, pid file
#                                 (default ~/mlflow)
#   MLFLOW_BACKEND_STORE_URI      runs database (default sqlite:///$MLFLOW_DATA_DIR/mlflow.db;
#                                 postgresql://USER@HOST:5432/mlflow for a larger team)
#   MLFLOW_ARTIFACTS_DESTINATION  where the server stores artifacts, e.g. s3://BUCKET/mlflow (default
#                                 $MLFLOW_DATA_DIR/artifacts). Proxied: clients need no S3 credentials.
#   MLFLOW_HOST, MLFLOW_PORT      listen address (default 127.0.0.1) and port (default 5000); beyond
#                                 loopback and private addresses, needs RAYTRN_MLFLOW_AUTH=1 (or _INSECURE=1)
#   MLFLOW_WORKERS                server worker processes (default 1; more only with PostgreSQL)
#   RAYTRN_MLFLOW_AUTH=1          basic auth. Requires MLFLOW_AUTH_ADMIN_PASSWORD (the admin user's
#                                 password, >= 12 characters, used when the users db is created) and
#                                 MLFLOW_FLASK_SERVER_SECRET_KEY (signs UI sessions). Never defaults.
#   MLFLOW_BIN                    the mlflow executable (default: mlflow on PATH)
#   MLFLOW_DISABLE_TELEMETRY      MLflow's usage reports to its makers (default true: none; false sends them)
# The same command as `raytrn mlflow serve` (raytrn/tracking/server.py); a unit test keeps them equal.
set -euo pipefail

die() { echo "mlflow/serve.sh: error: $*" >&2; exit 2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
workers="${MLFLOW_WORKERS:-1}"
dry_run=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) [ $# -ge 2 ] || die "--workers needs a number"; workers="$2"; shift 2 ;;
    --workers=*) workers="${1#--workers=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (options of mlflow server go after --)" ;;
  esac
done
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || die "--workers '$workers': must be a whole number >= 1"

data_dir="${MLFLOW_DATA_DIR:-$HOME/mlflow}"
mkdir -p "$data_dir" || die "MLFLOW_DATA_DIR=$data_dir: cannot create it"
data_dir="$(cd "$data_dir" && pwd)"  # absolute: the ini and the sqlite URIs need absolute paths
backend="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$data_dir/mlflow.db}"
# What is shown of it: the password masked whatever it holds (it runs to the last "@": "/", "#", "?" too).
shown_backend="$(printf '%s' "$backend" | sed -E 's#(://[^/:[:space:]]*):.*@#\1:***@#')"
case "$backend" in
  sqlite:////*|postgresql://*|postgresql+*://*|mysql://*|mysql+*://*|mssql+*://*) ;;
  sqlite:///*) die "MLFLOW_BACKEND_STORE_URI=$shown_backend: use an absolute path, sqlite:////ABS/PATH/mlflow.db" ;;
  *) die "MLFLOW_BACKEND_STORE_URI=$shown_backend: not a database URI (sqlite:////ABS/PATH/mlflow.db or postgresql://USER@HOST:5432/DB)" ;;
esac
artifacts="${MLFLOW_ARTIFACTS_DESTINATION:-$data_dir/artifacts}"
case "$artifacts" in
  s3://?*|gs://?*|wasbs://?*|hdfs://?*|file:///*|/*) ;;
  *) die "MLFLOW_ARTIFACTS_DESTINATION=$artifacts: use s3://BUCKET/PREFIX or an absolute directory" ;;
esac
host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
[[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] || die "MLFLOW_PORT=$port: not a TCP port"
mlflow_bin="${MLFLOW_BIN:-mlflow}"

cmd=("$mlflow_bin" server)
# A database password goes to the server through its environment, never its command line (`ps` shows that to
# every user of the machine) nor server.log.
case "$backend" in
  *://*:*@*) export MLFLOW_BACKEND_STORE_URI="$backend" ;;
  *) cmd+=(--backend-store-uri "$backend") ;;
esac
cmd+=(--artifacts-destination "$artifacts" --host "$host" --port "$port" --workers "$workers")
# Beyond loopback and private addresses (a wildcard, a public address, a host name) only with basic auth.
case "$host" in
  127.*|::1|localhost|10.*|192.168.*|172.1[6-9].*|172.2[0-9].*|172.3[01].*|f[cd]*:*) ;;
  *) [ "${RAYTRN_MLFLOW_AUTH:-0}" = 1 ] || [ "${RAYTRN_MLFLOW_INSECURE:-0}" = 1 ] ||
       die "MLFLOW_HOST=$host without RAYTRN_MLFLOW_AUTH=1: the server would be reachable beyond this machine and its private network, and anyone who can reach port $port could read, change and delete every run. Turn on basic auth (RAYTRN_MLFLOW_AUTH=1), or listen on 127.0.0.1 or a private address; RAYTRN_MLFLOW_INSECURE=1 serves it open anyway" ;;
esac
# MLflow 3.x's job-execution worker roughly doubles the server's memory; raytrn does not use it.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
# MLflow's usage telemetry (reports to MLflow's makers): off unless set, as in raytrn's own processes (raytrn.telemetry).
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"

if [ "${RAYTRN_MLFLOW_AUTH:-0}" = 1 ]; then
  missing=()
  [ -n "${MLFLOW_AUTH_ADMIN_PASSWORD:-}" ] || missing+=(MLFLOW_AUTH_ADMIN_PASSWORD)
  [ -n "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ] || missing+=(MLFLOW_FLASK_SERVER_SECRET_KEY)
  [ ${#missing[@]} -eq 0 ] || die "RAYTRN_MLFLOW_AUTH=1: ${missing[*]} not set (no defaults: set them from your secret store)"
  [ ${#MLFLOW_AUTH_ADMIN_PASSWORD} -ge 12 ] || die "MLFLOW_AUTH_ADMIN_PASSWORD is shorter than 12 characters (MLflow's password policy)"
  # Render the template with absolute paths; the admin password is never written to the file.
  sed "s|@AUTH_DATABASE_URI@|sqlite:///$data_dir/basic_auth.db|" "$here/basic_auth.ini" > "$data_dir/basic_auth.ini"
  export MLFLOW_AUTH_CONFIG_PATH="$data_dir/basic_auth.ini"
  cmd+=(--app-name basic-auth)
fi
cmd+=("${extra[@]}")

if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  echo "mlflow/serve.sh: store $shown_backend" >&2
  exit 0
fi
# Fail early and clearly when the port is taken (connect check; no listener -> connection refused).
probe="$host"; [ "$probe" = 0.0.0.0 ] && probe=127.0.0.1
if (exec 3<>"/dev/tcp/$probe/$port") 2>/dev/null; then
  die "$host:$port is already in use (another MLflow server? pid file: $data_dir/server.pid)"
fi
case "$artifacts" in /*) mkdir -p "$artifacts" ;; esac
echo $$ > "$data_dir/server.pid"  # exec keeps this PID: `kill $(cat server.pid)` stops the server
echo "mlflow/serve.sh: tracking URI http://$host:$port (store $shown_backend, artifacts $artifacts)" >&2
exec "${cmd[@]}"
