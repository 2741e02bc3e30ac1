-- Time filters: the since/until arguments of memory.query and GET /memory/query, parsed
-- once here so SQL and HTTP read them alike. The stage functions take the parsed range as
-- since (inclusive) and before (exclusive) timestamptz; nodes without a timestamp never
-- pass a time filter.
--
-- Parsing uses regular expressions and range checks instead of a cast inside an
-- EXCEPTION block: an exception block opens a subtransaction, which parallel mode forbids.

CREATE OR REPLACE FUNCTION memory.time_bound(value text, name text, upper_bound boolean)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g text[];
    y integer;
    mo integer;
    d integer;
    tzh integer := 0;
    tzm integer := 0;
    ok boolean;
    ts timestamp;
BEGIN
    IF value IS NULL THEN
        RETURN NULL;
    END IF;
    g := regexp_match(btrim(value),
        '^([0-9]{4})-([0-9]{2})-([0-9]{2})'
        '(?:[T ]([0-9]{2}):([0-9]{2})(?::([0-9]{2}(?:\.[0-9]{1,6})?))?(Z|[+-][0-9]{2}(?::?[0-9]{2})?)?)?$');
    ok := g IS NOT NULL;
    IF ok THEN
        -- Range checks first: make_date below must only ever see a valid year and month.
        y := g[1]::integer; mo := g[2]::integer; d := g[3]::integer;
        IF g[7] ~ '^[+-]' THEN
            tzh := substr(g[7], 2, 2)::integer;
            tzm := CASE WHEN length(g[7]) > 3 THEN right(g[7], 2)::integer ELSE 0 END;
        END IF;
        ok := y >= 1 AND mo BETWEEN 1 AND 12 AND d >= 1
              AND coalesce(g[4]::integer, 0) <= 23 AND coalesce(g[5]::integer, 0) <= 59
              AND coalesce(g[6]::numeric, 0) < 60 AND tzh <= 15 AND tzm <= 59;
    END IF;
    IF ok THEN
        ok := d <= extract(day FROM make_date(y, mo, 1) + interval '1 month' - interval '1 day');
    END IF;
    IF NOT ok THEN
        RAISE EXCEPTION '% must be an ISO date or timestamp, got "%"', name, value
            USING ERRCODE = '22023',
                  HINT = format('For example %s => ''2023-05-08'' (a whole day, UTC) or ''2023-05-08T13:56:00Z''.', name);
    END IF;
    IF g[4] IS NULL THEN
        -- A date is a whole UTC day: as an upper bound it includes that day.
        RETURN (make_date(y, mo, d) + CASE WHEN upper_bound THEN 1 ELSE 0 END)::timestamp AT TIME ZONE 'UTC';
    END IF;
    ts := make_timestamp(y, mo, d, g[4]::integer, g[5]::integer, coalesce(g[6]::double precision, 0));
    -- Without an offset a timestamp is UTC. As an upper bound it includes the whole unit of
    -- its precision, as a date includes its whole day: until 13:56 includes 13:56:30 (the
    -- minute), 13:56:30 includes 13:56:30.4 (the second), 13:56:30.5 includes up to, not
    -- including, 13:56:30.6 (one unit of its last digit).
    RETURN (ts - CASE WHEN left(g[7], 1) = '-' THEN -1 ELSE 1 END * make_interval(hours => tzh, mins => tzm))
           AT TIME ZONE 'UTC'
           + CASE WHEN NOT upper_bound THEN interval '0'
                  WHEN g[6] IS NULL THEN interval '1 minute'
                  WHEN strpos(g[6], '.') = 0 THEN interval '1 second'
                  ELSE make_interval(secs => 10.0::double precision ^ (3 - length(g[6])))
             END;
END $$;
COMMENT ON FUNCTION memory.time_bound(text, text, boolean) IS
    'Parses one bound of a time filter: an ISO date (a whole UTC day) or timestamp (UTC unless it carries an offset). upper_bound: the result is exclusive and includes the whole day, minute (hh:mm), second (hh:mm:ss) or last fractional digit given. 22023 naming the argument when the value is not an ISO date or timestamp.';

CREATE OR REPLACE FUNCTION memory.time_range(
    since text, until text, OUT since_ts timestamptz, OUT before_ts timestamptz
)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    since_ts := memory.time_bound(since, 'since', false);
    before_ts := memory.time_bound(until, 'until', true);
    IF since_ts >= before_ts THEN
        RAISE EXCEPTION 'since (%) is after until (%)', since, until
            USING ERRCODE = '22023',
                  HINT = 'since is the first day or instant to include and until the last; swap them.';
    END IF;
END $$;
COMMENT ON FUNCTION memory.time_range(text, text) IS
    'The time filter of memory.query and GET /memory/query: since and until (inclusive ISO dates or timestamps, either may be NULL) as since_ts (inclusive) and before_ts (exclusive), the arguments the stage functions take. 22023 naming the argument on a bad value, or when since is after until.';

CREATE OR REPLACE FUNCTION memory.check_reference_time(reference_time timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- The optimizer's bounds (poimen_core.optimizer.check_reference_time): every relative
    -- date the reference anchors stays within the years Python and PostgreSQL both hold.
    IF reference_time IS NOT NULL AND NOT (
        isfinite(reference_time)
        AND extract(year FROM reference_time AT TIME ZONE 'UTC')
            BETWEEN @vocabulary.reference_first_year@ AND @vocabulary.reference_last_year@) THEN
        RAISE EXCEPTION '%, got %', @vocabulary.reference_time_rule@, reference_time
            USING ERRCODE = '22023', HINT = @vocabulary.reference_time_hint@;
    END IF;
    RETURN reference_time;
END $$;
COMMENT ON FUNCTION memory.check_reference_time(timestamptz) IS
    'Returns reference_time (NULL: now, for the caller) unless it is infinite or its UTC year is outside 2..9998: then 22023. What the optimizer and the planner take.';
