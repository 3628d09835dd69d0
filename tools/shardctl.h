/* shardctl's pieces in files of their own (shardctl.c is the command line and the tables). */
#ifndef SHARDCTL_H
#define SHARDCTL_H

#include <jansson.h>
#include <stdbool.h>

/* o's string member key ("" when absent), and its integer member (0 when absent) */
static inline const char *str(json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : "";
}

static inline long long num(json_t *o, const char *key)
{
    return (long long)json_integer_value(json_object_get(o, key));
}

/* shardctl trace: the flight recorder documents of the daemon's jobs, as text */
void shardctl_trace_print(json_t *jobs);
/* shardctl trace --merge PATH...: dumps (files, or directories of them) of a job's nodes read
 * together; 0, or 1 when a file could not be read */
int shardctl_trace_merge(int n_paths, char **paths, bool as_json);

/* shardctl plan's options (--pick: rank every per-state plan instead of costing --plan) */
struct plan_args {
    unsigned long long params, max_rank_bytes;
    long world, k, package, accum, f_os;
    bool regather, pick, last_marked;
    const char *plan, *dtype, *optimizer;
    double gbit, compute_s;
};
/* one of plan's options with its value: 0, -1 not one of them, -2 a bad value (said) */
int shardctl_plan_arg(struct plan_args *a, const char *key, const char *val);
/* shardctl plan: 0, 1 (refused: said), 2 (bad arguments: said) */
int shardctl_plan(const struct plan_args *a, bool as_json);

#endif
