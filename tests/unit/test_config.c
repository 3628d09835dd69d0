/* The config table, JSON loading and its errors, size parsing, status text. */
#include "harness.h"
#include "sd/config.h"
#include "sd/status.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

int main(void)
{
    struct sd_config c;
    char err[512];
    sd_config_defaults(&c);
    TH_CHECK(c.op_timeout_ms == 30000 && c.nodes == 1 && strcmp(c.backend, "host") == 0 &&
                 c.max_message_bytes == 16u << 20 && strcmp(c.runtime_dir, "/run/shardd") == 0,
             "defaults");
    TH_CHECK(sd_config_set(&c, "max_message_bytes", "64KiB", err, sizeof(err)) == 0 &&
                 c.max_message_bytes == 65536,
             "size option");
    TH_CHECK(sd_config_set(&c, "op_timeout_ms", "abc", err, sizeof(err)) == SD_ECONFIG &&
                 strstr(err, "op_timeout_ms") && strstr(err, "'abc'"),
             "bad int names key and value: %s", err);
    TH_CHECK(sd_config_set(&c, "op_timeout_ms", "0", err, sizeof(err)) == SD_ECONFIG &&
                 strstr(err, "[1, 3600000]"),
             "out of range: %s", err);
    TH_CHECK(sd_config_set(&c, "no_such", "1", err, sizeof(err)) == SD_ECONFIG &&
                 strstr(err, "unknown option 'no_such'"),
             "unknown key: %s", err);
    TH_CHECK(sd_config_set(&c, "log_level", "loud", err, sizeof(err)) == SD_ECONFIG &&
                 strstr(err, "loud"),
             "bad enum: %s", err);
    TH_CHECK(sd_config_set(&c, "backend", "tpu", err, sizeof(err)) == SD_ECONFIG, "bad backend");
    /* devices: a list of GPU indices, cycled over the local ranks */
    int devs[SD_CONFIG_MAX_DEVICES];
    TH_CHECK(sd_config_devices("", devs, 4, err, sizeof(err)) == 0 &&
                 sd_config_devices("3", devs, 4, err, sizeof(err)) == 1 && devs[0] == 3 &&
                 sd_config_devices("0,1,1,0", devs, 4, err, sizeof(err)) == 4 && devs[0] == 0 &&
                 devs[1] == 1 && devs[2] == 1 && devs[3] == 0,
             "devices: empty, '3', '0,1,1,0' read in order");
    TH_CHECK(sd_config_devices("0,1,2,3,4", devs, 4, err, sizeof(err)) == SD_ECONFIG &&
                 strstr(err, "more than 4") != NULL,
             "devices longer than the most refused: %s", err);
    TH_CHECK(sd_config_set(&c, "devices", "5,5", err, sizeof(err)) == 0 &&
                 strcmp(c.devices, "5,5") == 0,
             "devices set: %s", err);
    TH_CHECK(sd_config_set(&c, "devices", "0,1", err, sizeof(err)) == 0 &&
                 strcmp(c.devices, "0,1") == 0,
             "devices naming two GPUs taken: %s", err);
    static const char *const bad[] = {"a", "1,", ",1", "1;2", "-1", "1 ", "2048"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        TH_CHECK(sd_config_set(&c, "devices", bad[i], err, sizeof(err)) == SD_ECONFIG &&
                     strstr(err, "devices") != NULL,
                 "devices '%s' refused: %s", bad[i], err);

    char path[] = "/tmp/shardd-cfg-XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    write_file(path, "{\"op_timeout_ms\": 1234, \"memory_budget\": \"2GiB\", \"log_level\": "
                     "\"debug\"}");
    sd_config_defaults(&c);
    TH_CHECK(sd_config_load_file(&c, path, err, sizeof(err)) == 0 && c.op_timeout_ms == 1234 &&
                 c.memory_budget == 2ULL << 30 && strcmp(c.log_level, "debug") == 0,
             "load: %s", err);
    write_file(path, "{\"op_timeout_ms\": 5, \"bogus\": 1}");
    TH_CHECK(sd_config_load_file(&c, path, err, sizeof(err)) == SD_ECONFIG &&
                 strstr(err, "bogus") && strstr(err, path),
             "unknown key in file: %s", err);
    write_file(path, "{\"nodes\": [1]}");
    TH_CHECK(sd_config_load_file(&c, path, err, sizeof(err)) == SD_ECONFIG &&
                 strstr(err, "nodes") && strstr(err, "[1]"),
             "wrong type: %s", err);
    write_file(path, "{\"nodes\": 2,\n \"node\": }");
    TH_CHECK(sd_config_load_file(&c, path, err, sizeof(err)) == SD_ECONFIG && strstr(err, "line 2"),
             "syntax error with line: %s", err);
    write_file(path, "[1, 2]");
    TH_CHECK(sd_config_load_file(&c, path, err, sizeof(err)) == SD_ECONFIG && strstr(err, "object"),
             "not an object: %s", err);
    unlink(path);

    static const struct {
        const char *text;
        int status;
        uint64_t v;
    } sizes[] = {{"0", 0, 0},           {"4096", 0, 4096},       {"64K", 0, 65536},
                 {"64KiB", 0, 65536},   {"2MB", 0, 2u << 20},    {"1g", 0, 1u << 30},
                 {"3T", 0, 3ULL << 40}, {"", SD_EINVAL, 0},      {"-1", SD_EINVAL, 0},
                 {"12Q", SD_EINVAL, 0}, {"5KiBx", SD_EINVAL, 0}, {"99999999999999T", SD_EINVAL, 0}};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint64_t v = 0;
        int st = sd_parse_size(sizes[i].text, &v);
        TH_CHECK(st == sizes[i].status && (st != 0 || v == sizes[i].v), "size '%s': %d %llu",
                 sizes[i].text, st, (unsigned long long)v);
    }
    TH_CHECK(strcmp(sd_status_str(SD_EMISMATCH), "mismatch between ranks") == 0, "project text");
    TH_CHECK(strcmp(sd_status_name(SD_ENOUNIT), "SD_ENOUNIT") == 0, "names");
    TH_CHECK(strcmp(sd_status_str(-EACCES), "Permission denied") == 0, "errno text");
    TH_CHECK(strcmp(sd_status_str(-5555), "unknown status") == 0, "unknown");
    return th_summary("test_config");
}
