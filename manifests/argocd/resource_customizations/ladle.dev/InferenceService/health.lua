-- Argo CD health of a Ladle InferenceService, from the conditions the operator (Ready,
-- Progressing, Reconciling, Stalled, Degraded) and the gateway (ModelNameConflict) write, and
-- from status.rollout, which the canary controller writes.
local hs = {status = "Progressing", message = "Waiting for the operator to report status"}

if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  hs.message = "Being deleted"
  return hs
end
if obj.status == nil or obj.status.conditions == nil then
  return hs
end

-- Status written for an older spec says nothing about the current one.
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = {}
for _, condition in ipairs(obj.status.conditions) do
  conditions[condition.type] = condition
end
local function is_true(kind)
  return conditions[kind] ~= nil and conditions[kind].status == "True"
end
local function describe(condition)
  local text = condition.reason or condition.type
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end

-- Progress needs someone to act (kstatus's Stalled).
if is_true("Stalled") then
  hs.status = "Degraded"
  hs.message = describe(conditions["Stalled"])
  return hs
end

local rollout = obj.status.rollout
local canary = ""
if rollout ~= nil and rollout.step ~= nil then
  canary = " at step " .. tostring(rollout.step)
end
if rollout ~= nil and rollout.phase == "Paused" then
  hs.status = "Suspended"
  hs.message = "Canary rollout paused" .. canary
  return hs
end

-- After a rollback the stable revision still serves (Ready), but the change did not land.
if is_true("Degraded") then
  hs.status = "Degraded"
  hs.message = describe(conditions["Degraded"])
  return hs
end
local conflict = conditions["ModelNameConflict"]
if conflict ~= nil and conflict.status == "True" and conflict.reason == "RoutedElsewhere" then
  hs.status = "Degraded"
  hs.message = describe(conflict)
  return hs
end

if rollout ~= nil and rollout.phase == "Progressing" then
  hs.message = "Canary rollout in progress" .. canary
  return hs
end
if is_true("Progressing") or is_true("Reconciling") then
  local progressing = conditions["Progressing"] or conditions["Reconciling"]
  hs.message = describe(progressing)
  return hs
end

local ready = conditions["Ready"]
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end
if ready ~= nil and ready.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(ready)
  return hs
end
hs.message = "Waiting for the Ready condition"
return hs
